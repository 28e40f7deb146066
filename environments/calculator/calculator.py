"""Multi-digit arithmetic with a calculator: a Flywheel tool environment with two Python tools and per-rollout
state. A small model cannot multiply 347 by 86 in its head; with the tools it only has to call them and copy the
result."""

import random
import re

from flywheel.env import Environment, Rubric


def multiply(a: int, b: int, state: dict) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    state["calls"] = state.get("calls", 0) + 1
    return a * b


def add(a: int, b: int, state: dict) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    state["calls"] = state.get("calls", 0) + 1
    return a + b


def correct(completion: str, answer: int) -> float:
    """1.0 when the last number of the final answer is the result."""
    numbers = re.findall(r"-?\d+", completion.replace(",", ""))
    return float(bool(numbers) and int(numbers[-1]) == answer)


def used_tools(state: dict) -> dict:
    """A logged metric (weight 0): how many tool calls the rollout made."""
    return {"score": None, "calls": state.get("calls", 0)}


def load_environment(n: int = 400, digits: int = 3, seed: int = 0) -> Environment:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = (rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(3))
        rows.append({"question": f"What is {a} * {b} + {c}?", "answer": a * b + c})
    return Environment(
        dataset=rows, tools=[multiply, add], max_turns=4, name="calculator",
        rubric=Rubric([correct, used_tools], weights=[1.0, 0.0]),
        system_prompt="Use the tools for the arithmetic, then give the final number.",
    )
