"""Ten varied prompts for integration tests and benchmarks on the embedded model."""
PROMPTS = [
    "What is the capital of France?",
    "Write a numbered list of five fruits.",
    "Explain photosynthesis in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tell me a short story about a robot who learns to paint.",
    "What are three tips for staying focused while studying?",
    "Translate 'good morning, my friend' into Spanish and French.",
    "List the days of the week.",
    "Why is the sky blue?",
    "Give me a recipe for a simple tomato pasta.",
]
