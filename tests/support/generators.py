"""A task generator for the scheduler's tests: ``make(n, seed, split, **params)`` like the shipped
domain modules, cheap and deterministic, with a ``fail`` parameter that makes it raise."""

from __future__ import annotations

import random


def make(n: int, seed: int = 0, split: str = "train", pattern: str = "^a", digits: int = 1, fail: bool = False,
         samples_per_task: int = 2, limit: int | None = None) -> list[dict]:
    """``n`` regex tasks (``pattern``) whose prompt holds ``digits`` random digits; ``limit`` caps how many
    distinct prompts exist (a generator that runs dry). Raises ValueError when ``fail``."""
    if fail:
        raise ValueError("this level cannot be built (fail=True)")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(limit) if limit else rng.randrange(10 ** (digits + 6))
        q = f"{split} {digits} {k:0{digits}d}"
        out.append({"task_id": f"g{k}", "domain": "generated", "prompt": [{"role": "user", "content": q}],
                    "verifier": {"kind": "regex", "pattern": pattern}, "samples_per_task": samples_per_task})
    return out
