"""Arithmetic with a second chance: a multi-turn Flywheel environment in which the model answers, is told whether
the answer was right, and may try again. The smallest execute-observe-revise loop: the observation is a check of
the model's own answer, and the reward pays more for getting it right sooner (1 at the first answer, 1/2 at the
second, 1/4 at the third), so a policy learns both to answer right and to use the feedback when it did not.

The questions are the main job's (one-digit sums and differences, ``examples/arithmetic.yaml``), written the
way reasoning-gym's ``basic_arithmetic`` writes them."""

import random
import re

from flywheel.env import Environment, Rubric

RETRY = "That is not right. Answer again with only the final number."
"""The observation after a wrong answer (a ``user`` turn)."""


def _last_number(text: str) -> int | None:
    numbers = re.findall(r"(?<![\d)])-?\d+", text)
    return int(numbers[-1]) if numbers else None


def setup(state: dict, answer: int) -> None:
    state.update(answer=answer, answers=[])


def env_response(completion: str, state: dict) -> str | None:
    """After each answer: ``None`` (done) when it is right, else the retry prompt."""
    guess = _last_number(completion)
    state["answers"].append(guess)
    if guess == state["answer"]:
        state["solved_at"] = len(state["answers"])
        return None
    return RETRY


def solved(state: dict, completion: str) -> float:
    """1 / 2^(k-1) when the k-th answer was right, 0 when none was. ``completion`` is the last answer, which no
    ``env_response`` checked when the rollout ran out of turns or tokens after it: it counts here."""
    if "solved_at" not in state and _last_number(completion) == state.get("answer"):
        state["solved_at"] = len(state.get("answers", [])) + 1  # a checked right answer would have ended the rollout
    k = state.get("solved_at")
    return 0.0 if k is None else 0.5 ** (k - 1)


def first_try(state: dict) -> dict:
    """Logged metrics (weight 0): whether the first answer was right, and how many answers the rollout gave."""
    return {"score": None, "first_try": float(state.get("solved_at") == 1), "answers": len(state.get("answers", []))}


def load_environment(n: int = 200, max_turns: int = 3, seed: int = 0) -> Environment:
    """``n`` (at most 200) of the 200 questions ``a + b`` and ``a - b`` for one-digit a, b, shuffled by ``seed``;
    at most ``max_turns`` answers per rollout."""
    rows = [{"question": f"Calculate {a} {op} {b} =", "answer": a + b if op == "+" else a - b}
            for a in range(10) for b in range(10) for op in "+-"]
    random.Random(seed).shuffle(rows)
    return Environment(dataset=rows[:n], setup=setup, env_response=env_response, max_turns=max_turns,
                       rubric=Rubric([solved, first_try], weights=[1.0, 0.0]), name="arithmetic_retry",
                       system_prompt="Answer with only the final number.")
