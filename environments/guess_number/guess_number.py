"""Guess the number: a multi-turn Flywheel environment with feedback turns, in a domain that is not code. Each
wrong guess gets a hint (higher or lower); the reward is 1 for finding the number, less the more guesses it took."""

import random
import re

from flywheel.env import Environment, Rubric


def setup(state: dict, answer: int) -> None:
    state.update(secret=answer, guesses=[])


def _guess(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def env_response(completion: str, state: dict) -> str | None:
    """The hint after a guess, or None when the number was found."""
    guess = _guess(completion)
    state["guesses"].append(guess)
    if guess is None:
        return "Answer with one number."
    if guess == state["secret"]:
        state["found"] = True
        return None
    return "Higher." if guess < state["secret"] else "Lower."


def found(state: dict) -> float:
    """1.0 at the first guess, 0.1 less for each extra one; 0 when never found."""
    if not state.get("found"):
        return 0.0
    return max(0.5, 1.0 - 0.1 * (len(state["guesses"]) - 1))


def guesses(state: dict) -> dict:
    """A logged metric (weight 0): how many guesses the rollout made."""
    return {"score": None, "count": len(state.get("guesses", []))}


def load_environment(n: int = 400, high: int = 16, max_turns: int = 6, seed: int = 0) -> Environment:
    rng = random.Random(seed)
    rows = [{"question": f"I am thinking of a number from 1 to {high}. Guess it; I will say higher or lower. "
                         f"(game {i})", "answer": rng.randint(1, high)} for i in range(n)]
    return Environment(dataset=rows, setup=setup, env_response=env_response, max_turns=max_turns,
                       rubric=Rubric([found, guesses], weights=[1.0, 0.0]), name="guess_number",
                       system_prompt="Answer with one number each turn.")
