"""Sort a few numbers: a single-turn Flywheel environment with a Python reward."""

import random
import re

from flywheel.env import Environment, Rubric


def sorted_answer(completion: str, answer: list[int]) -> float:
    """1.0 for exactly the sorted list, else the share of positions already right."""
    got = [int(x) for x in re.findall(r"-?\d+", completion)]
    if got == answer:
        return 1.0
    return sum(g == a for g, a in zip(got, answer)) / len(answer) * 0.5


def brevity(completion: str) -> dict:
    """A logged metric only (weight 0): how long the answer is."""
    return {"score": None, "chars": len(completion)}


def load_environment(n: int = 500, size: int = 4, seed: int = 0) -> Environment:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers = rng.sample(range(100), size)
        rows.append({"question": "Sort ascending: " + ", ".join(map(str, numbers)), "answer": sorted(numbers)})
    return Environment(
        dataset=rows,
        rubric=Rubric([sorted_answer, brevity], weights=[1.0, 0.0]),
        system_prompt="Answer with the numbers only, comma-separated.",
        name="sort_numbers",
    )
