"""Instructions for self-distillation: a seeded generator of varied prompts (templates x topics), and the
held-out evaluation prompts, which share no topic (and so no prompt) with the training ones.

Eight kinds, as a chat model is used: questions, explanations, lists, how-tos, short stories, simple
code, arithmetic and rewriting. Topic-bearing kinds draw from TOPICS; a topic belongs to the evaluation
split when `_held_out(topic)` says so, for every template, so `eval_prompts()` and `training_prompts()`
are disjoint by construction (and a test checks it on the generated text).

Training also draws on everyday requests of other shapes (CHAT_KINDS: recipes, notes and emails, advice,
word problems, unit conversions, SQL and shell, idioms, conversations, pros and cons, "why" questions),
split by the same hash. The evaluation prompts come from the eight kinds only, so the shipped adapters'
recorded evaluations keep reproducing; `bench/ordinary-prompts.txt` is the broad held-out set.
"""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

from studio.errors import BadInput

TOPIC_TEMPLATES = [
    # questions
    "What is {t}?", "Why is {t} important?", "Who uses {t}, and for what?", "What are the main parts of {t}?",
    "What is the history of {t} in a few sentences?",
    # explanations
    "Explain {t} in simple terms.", "Explain {t} to a ten-year-old.", "Explain {t} in two sentences.",
    "Describe how {t} works.", "What is the difference between {t} and {u}?",
    # lists
    "Write a numbered list of five facts about {t}.", "List three advantages and three disadvantages of {t}.",
    "Give me a bulleted list of key terms related to {t}.", "List four common misconceptions about {t}.",
    "Write a numbered list of questions a student might ask about {t}.",
    # how-tos
    "How do I get started with {t}?", "Give step-by-step instructions for learning about {t}.",
    "What are five tips for someone interested in {t}?", "How can {t} be explained in a classroom?",
    # short stories and writing
    "Write a short story about {t}.", "Write a four-line poem about {t}.",
    "Write a short dialogue between two friends about {t}.", "Write a short news headline and summary about {t}.",
    "Write a haiku about {t}.",
]

TOPICS = [
    "photosynthesis", "volcanoes", "the water cycle", "gravity", "black holes", "the moon", "earthquakes",
    "rainbows", "electricity", "magnets", "the human heart", "the immune system", "DNA", "vaccines", "sleep",
    "exercise", "healthy eating", "coffee", "tea", "chocolate", "bread baking", "gardening", "composting",
    "recycling", "solar energy", "wind power", "climate change", "the ocean", "coral reefs", "rainforests",
    "deserts", "mountains", "rivers", "honeybees", "ants", "dolphins", "elephants", "penguins", "wolves",
    "cats", "dogs", "horses", "birds migrating", "dinosaurs", "fossils", "the Roman Empire",
    "ancient Egypt", "the printing press", "the Industrial Revolution", "the internet", "email",
    "smartphones", "computers", "programming", "databases", "encryption", "passwords", "artificial intelligence",
    "robots", "video games", "chess", "football", "basketball", "swimming", "running a marathon", "yoga",
    "meditation", "music", "the piano", "the guitar", "painting", "photography", "movies", "theater",
    "libraries", "books", "poetry", "languages", "learning a new language", "mathematics", "prime numbers",
    "fractions", "geometry", "statistics", "probability", "money", "saving money", "budgeting", "banks",
    "taxes", "the stock market", "trade", "cities", "villages", "public transport", "bicycles", "cars",
    "electric cars", "trains", "airplanes", "ships", "space travel", "Mars", "the solar system", "stars",
    "telescopes", "microscopes", "cells", "bacteria", "viruses", "the brain", "memory", "emotions",
    "friendship", "teamwork", "leadership", "time management", "job interviews", "public speaking",
    "writing an essay", "note taking", "studying for exams", "online learning", "teachers", "schools",
    "universities", "museums", "maps", "the compass", "clocks", "calendars", "seasons", "weather forecasts",
    "snow", "thunderstorms", "hurricanes", "tides", "salt", "sugar", "water", "fire", "glass", "paper",
    "plastic", "steel", "wood", "cotton", "wool", "bridges", "skyscrapers", "castles", "pyramids", "roads",
    "farming", "rice", "wheat", "apples", "bananas", "potatoes", "tomatoes", "cooking pasta", "soup",
    "spices", "restaurants", "markets", "shopping", "advertising", "newspapers", "radio", "television",
    "social media", "kindness", "honesty", "curiosity", "patience", "hobbies", "camping", "hiking",
    "fishing", "the beach", "islands", "lighthouses", "trees", "flowers", "mushrooms", "frogs", "butterflies",
    "spiders", "sharks", "whales", "owls", "eagles", "rabbits", "tigers", "lions", "bears", "pandas",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the largest item in a list",
    "counts the vowels in a string", "computes the factorial of n", "returns the n-th Fibonacci number",
    "sums the even numbers in a list", "removes duplicates from a list", "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit", "returns the average of a list of numbers", "sorts a list of words by length",
    "counts how often each word appears in a sentence", "merges two sorted lists", "flattens a nested list",
    "returns the second smallest number in a list", "capitalizes every word in a sentence",
    "checks whether two strings are anagrams", "computes the greatest common divisor of two numbers",
    "returns the digits of a number as a list",
]
CODE_TEMPLATES = ["Write a Python function that {c}.", "Write a JavaScript function that {c}.",
                  "Write a short Python program that {c}, with a comment on each line.",
                  "Explain how to write a function that {c}."]

SENTENCES = [
    "the meeting was moved to next tuesday because many people were away",
    "i think we should try the new restaurant on the corner tonight",
    "the train was late again and everyone on the platform was annoyed",
    "our team finished the project two days before the deadline",
    "please remember to bring your notebook and a pen to class",
    "the weather is nice so lets go for a walk in the park",
    "he forgot his keys at home and had to wait outside for an hour",
    "the library will be closed on monday for repairs",
    "she learned to play the guitar by watching videos online",
    "we need more volunteers for the school fair next month",
    "the new phone has a better camera but the battery is weaker",
    "my grandmother makes the best apple pie in the whole town",
]
REWRITE_TEMPLATES = ["Rewrite this sentence in a formal tone: \"{s}\"", "Fix the grammar and punctuation: \"{s}\"",
                     "Summarize in five words: \"{s}\"", "Rewrite this sentence for a children's book: \"{s}\"",
                     "Translate into French: \"{s}\""]

ARITHMETIC = ["What is {a} + {b}?", "What is {a} times {b}?", "What is {a} minus {b}?",
              "If I have {a} apples and buy {b} more, how many do I have?",
              "A book costs {a} dollars and a pen costs {b} dollars. What do both cost together?",
              "Solve step by step: ({a} + {b}) * 2."]

# Everyday requests of more answer shapes: (template, the values its {x} takes). Each value is split by
# `_held_out`, so a held-out value never reaches training in any template.
CHAT_KINDS = [
    (["Give me a simple recipe for {x}.", "What ingredients do I need to make {x}?",
      "What are common mistakes when making {x}?"],
     ["banana bread", "fried rice", "tomato soup", "a fruit salad", "guacamole", "scrambled eggs", "lemonade",
      "vegetable curry", "oatmeal cookies", "a grilled cheese sandwich", "hummus", "pizza dough", "pancakes with berries", "chicken noodle soup", "a smoothie", "roasted vegetables", "porridge", "a simple omelette"]),
    (["Write a short email to {x}.", "Write a short note to {x}.", "How do I politely write to {x}?"],
     ["a teacher asking about homework", "a landlord about a broken heater", "a colleague thanking them for help",
      "a friend inviting them to dinner", "a customer apologising for a late delivery",
      "a coach saying I will miss practice", "a neighbour about a noisy party", "a doctor asking to move an appointment",
      "a team announcing a meeting", "a shop asking about a refund", "a grandparent on their birthday",
      "a new colleague welcoming them"]),
    (["What should I do if {x}?", "Give me some advice: {x}.", "How can I handle it when {x}?"],
     ["I cannot fall asleep at night", "my plants keep dying", "I feel nervous before an exam",
      "my laptop is running slowly", "I forgot a friend's birthday", "I want to drink more water",
      "my room is always messy", "I have too many emails", "I lose my keys often", "I want to read more books",
      "my dog barks at strangers", "I procrastinate on homework", "I want to make new friends in a new city",
      "my bike chain keeps falling off"]),
    (["Solve this and show your steps: {x}", "{x} Explain your answer."],
     ["A farmer has 48 eggs and packs them in boxes of 6. How many boxes does he fill?",
      "Tom reads 12 pages a day. How many pages does he read in two weeks?",
      "A car drives 60 km per hour for 3 hours. How far does it go?",
      "A pizza is cut into 8 slices and 3 are eaten. What fraction is left?",
      "A ticket costs 15 dollars. How much do 7 tickets cost?",
      "Anna is 9 years older than Ben, who is 14. How old is Anna?",
      "A rectangle is 7 cm wide and 12 cm long. What is its area?",
      "A class of 28 students splits into teams of 4. How many teams are there?",
      "A jar holds 250 ml. How many jars fill a 2 litre bottle?",
      "A shirt costs 40 dollars and is 25 percent off. What is the new price?",
      "A bus leaves at 9:45 and the trip takes 50 minutes. When does it arrive?",
      "Sara saves 5 dollars a week. How long until she has 120 dollars?"]),
    (["Convert {x} and explain the steps.", "How do I convert {x}?"],
     ["5 miles to kilometres", "30 degrees Celsius to Fahrenheit", "2.5 hours to minutes", "3 kilograms to pounds",
      "500 grams to ounces", "1.8 metres to feet and inches", "90 minutes to hours", "10 litres to gallons",
      "100 kilometres per hour to miles per hour", "45 degrees to radians"]),
    (["Write a SQL query that {x}.", "Write a bash command that {x}.", "Explain how to write code that {x}."],
     ["lists all customers from Canada", "counts the rows in a table called users",
      "finds the five largest files in a folder", "shows the average salary per department",
      "deletes empty lines from a text file", "renames every .jpeg file to .jpg", "finds duplicate email addresses",
      "prints the current date and time", "joins an orders table with a customers table",
      "counts the words in a file"]),
    (["What does the phrase \"{x}\" mean?", "Use the phrase \"{x}\" in two example sentences."],
     ["a piece of cake", "hit the sack", "under the weather", "once in a blue moon", "spill the beans",
      "the ball is in your court", "cost an arm and a leg", "let the cat out of the bag", "on the same page",
      "bite off more than you can chew", "hit the nail on the head", "when pigs fly"]),
    (["Write a short conversation between {x}.", "Write a dialogue between {x}, with four lines each."],
     ["a student and a librarian", "a tourist and a taxi driver", "two friends planning a trip",
      "a patient and a dentist", "a child and a grandparent about the stars", "a chef and a food critic",
      "a shop assistant and a customer returning shoes", "two astronauts on the moon",
      "a detective and a witness", "a teacher and a parent"]),
    (["What are the pros and cons of {x}?", "Should I choose {x}? Give both sides."],
     ["living in a big city", "buying a used car", "studying abroad", "owning a cat", "taking a gap year",
      "renting instead of buying a home", "learning to code", "waking up early", "working in a team",
      "cooking at home every day", "taking the train instead of flying"]),
    (["Why do {x}?", "Explain why {x}."],
     ["leaves change colour in autumn", "we yawn", "onions make people cry", "birds sing in the morning",
      "boats float", "loaves of bread go stale", "we get hiccups", "stars twinkle", "metal spoons feel cold",
      "people get sunburned", "dogs wag their tails", "balloons pop in the sun"]),
]

EVAL_COUNT = 40


def _held_out(topic: str) -> bool:
    """One topic (or code task, or sentence) in eight goes to evaluation, by a stable hash of its text."""
    return hashlib.sha256(topic.encode()).digest()[0] % 8 == 0


def _all_prompts(held_out: bool) -> list[str]:
    """Every distinct prompt of one split, in a fixed order."""
    topics = [t for t in TOPICS if _held_out(t) == held_out]
    out = [tmpl.format(t=t, u=topics[(i + 7) % len(topics)]) for i, t in enumerate(topics) for tmpl in TOPIC_TEMPLATES]
    out += [tmpl.format(c=c) for c in CODE_TASKS if _held_out(c) == held_out for tmpl in CODE_TEMPLATES]
    out += [tmpl.format(s=s) for s in SENTENCES if _held_out(s) == held_out for tmpl in REWRITE_TEMPLATES]
    # arithmetic: operand pairs split the same way (by the text of the pair)
    pairs = [(a, b) for a in range(2, 60, 3) for b in range(3, 40, 4)]
    out += [tmpl.format(a=a, b=b) for a, b in pairs if _held_out(f"{a},{b}") == held_out for tmpl in ARITHMETIC]
    return out


def everyday_prompts(held_out: bool) -> list[str]:
    """Every distinct everyday request of one split (CHAT_KINDS), in a fixed order."""
    return [tmpl.format(x=x) for templates, values in CHAT_KINDS
            for x in values if _held_out(x) == held_out for tmpl in templates]


# asked of a prompt again, so a data set can outgrow the pool (a GPU campaign answers tens of thousands)
STYLES = ["Answer in two sentences.", "Keep it under fifty words.", "Explain it as you would to a ten-year-old.",
          "Use a numbered list.", "Start with a one-line summary.", "Give one example.", "Be brief.",
          "Answer in a friendly tone."]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct training prompts, a seeded sample of every kind. Beyond the pool (5,529 prompts) the pool is
    asked again with a style line after it (STYLES), up to nine times the pool; never a held-out topic.

    The everyday requests take up to a quarter of a sample: drawn in proportion to their share of the pool
    (a twentieth), a 2,048-prompt set would hold about a hundred of them."""
    rng = random.Random(seed)
    chat, topical = everyday_prompts(held_out=False), _all_prompts(held_out=False)
    picked = rng.sample(chat, min(len(chat), n // 4))
    picked += rng.sample(topical, min(n - len(picked), len(topical)))
    rng.shuffle(picked)
    if n > len(picked):
        pool = chat + topical
        styled = [f"{p} {style}" for style in STYLES for p in pool]
        picked += rng.sample(styled, min(n - len(picked), len(styled)))
    return picked


def eval_prompts(n: int = EVAL_COUNT) -> list[str]:
    """The held-out evaluation prompts: n of them, a fixed spread over the kinds."""
    pool = _all_prompts(held_out=True)
    return random.Random(1234).sample(pool, min(n, len(pool)))


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per non-empty line (UTF-8)."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise BadInput(f"prompt file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read prompt file {path}: {e}") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise BadInput(f"prompt file {path} has no prompts")
    return prompts
