"""Question sets for `dlm-studio bench --task`: short questions with known answers, scored the same for every
strategy, so accuracy can stand beside speed (docs/serving.md#the-accuracy-speed-trade-off).

A set is JSON Lines: `{"prompt": "...", "answer": "Paris"}` (or a list of accepted answers). An output is correct when
it contains an accepted answer as a whole word, ignoring case (`2 + 3 = 5.` answers "5"; "15" and "5.5" do not). The shipped
sets live beside this module (`studio/evaluation/questions/NAME.jsonl`); a task is a shipped name or a file path.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from studio.errors import BadInput
from studio.files import read_user_text

SHIPPED = Path(__file__).parent / "questions"


@dataclass(frozen=True)
class Question:
    prompt: str
    answers: tuple[str, ...]

    def correct(self, text: str) -> bool:
        # a whole word: not inside a longer word or number ("5" is not in "15" nor "5.5"; "5." ends a sentence)
        return any(re.search(rf"(?<![\w.]){re.escape(a)}(?!\w|\.\w)", text, re.IGNORECASE) for a in self.answers)


def shipped_tasks() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.jsonl"))


def load_task(spec: str) -> tuple[str, list[Question]]:
    """(the task's name, its questions) from a shipped name or a JSONL file; BadInput naming the line at fault."""
    path = SHIPPED / f"{spec}.jsonl" if spec in shipped_tasks() else Path(spec)
    if not path.exists():
        raise BadInput(f"no task {spec!r}: not a shipped task ({', '.join(shipped_tasks())}) nor a file")
    text = read_user_text(path, "task file")
    questions = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            prompt, answer = doc["prompt"], doc["answer"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise BadInput(f"{path}:{i}: expected a JSON object with 'prompt' and 'answer'") from None
        answers = [answer] if isinstance(answer, str) else answer
        if not (isinstance(prompt, str) and prompt.strip() and isinstance(answers, list) and answers
                and all(isinstance(a, str) and a.strip() for a in answers)):
            raise BadInput(f"{path}:{i}: 'prompt' must be a non-empty string and 'answer' one or a list of them")
        questions.append(Question(prompt, tuple(a.strip() for a in answers)))
    if not questions:
        raise BadInput(f"task file {path} has no questions")
    return path.stem, questions


def score(report: dict, name: str, questions: list[Question]) -> dict:
    """A bench report (`studio.run.bench.run_bench` on the questions' prompts) with accuracy: `task` (its name and
    each question's answers), every strategy's `accuracy` (correct outputs / outputs) and per question `correct`."""
    report["task"] = {"name": name, "answers": [list(q.answers) for q in questions]}
    for row in report["strategies"]:
        marks = []
        for q, per in zip(questions, row["per_prompt"]):
            per["correct"] = [q.correct(text) for text in per["text"]]
            marks += per["correct"]
        row["accuracy"] = sum(marks) / len(marks)
    return report
