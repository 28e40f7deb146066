"""Grade-school math word problems (reasoning-gym ``gsm_symbolic``) scored by math-verify.

Tasks carry :data:`RECIPE`: a completion cut off at the token budget earns 0 (``make(recipe=None)``
opts out).
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.domains.common import TRUNCATION_GATE, split_seed, task_body, with_recipe

RECIPE: dict[str, Any] | None = TRUNCATION_GATE
"""Recipe every task carries: a solution cut off mid-way is not an answer, even when the last number
it reached (which math-verify would read) is the gold."""

SYSTEM = "Solve the problem step by step, then put the final answer in \\boxed{}."


def make(n: int, seed: int = 0, split: str = "train", samples_per_task: int = 8, difficulty: float = 1.0,
         recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """``n`` distinct problems; the gold is the dataset's numeric answer. Each task carries ``recipe``
    (default :data:`RECIPE`; ``None``: none, the verifier service's recipe for the domain).

    Raises:
        ValueError: ``recipe`` is not a valid recipe.
    """
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n * 2 + 8, seed=split_seed(seed, split), difficulty=difficulty)
    out, seen = [], set()
    for i in range(len(ds)):
        e = ds[i]
        if e["question"] in seen:
            continue
        seen.add(e["question"])
        out.append(task_body("gsm_symbolic", split, e["question"], e["question"],
                             with_recipe({"kind": "math", "answer": str(e["answer"])}, recipe), system=SYSTEM,
                             samples_per_task=samples_per_task, metadata={"answer": str(e["answer"])}))
        if len(out) == n:
            break
    return out


def gold(task: dict) -> str:
    return f"The answer is \\boxed{{{task['verifier']['answer']}}}."


def corrupt(task: dict, rng: random.Random) -> str:
    """The gold answer plus a non-zero integer."""
    a = task["verifier"]["answer"]
    try:
        wrong = str(float(a) + rng.choice([-3, -2, -1, 1, 2, 3]))
    except ValueError:
        wrong = a + "1"
    return f"The answer is \\boxed{{{wrong}}}."
