"""The toy domain a tiny random model learns in seconds: reward 1 when the completion matches a regex.

The prompt is noise (4 random digits, the split's letter and the item's index, as the ``toy_prefix``
task source of :mod:`flywheel.tasks` makes them); the verifier is ``{"kind": "regex", "pattern": ...}``,
searched from the start of the completion (anchor the pattern with ``^``). :data:`LEVELS` are patterns
of rising difficulty (a lowercase first letter, then two, then three), so a scheduler domain with an
adaptive curriculum can promote a tiny model from one to the next (``examples/many_domains.yaml``).
"""

from __future__ import annotations

import random
import string
from typing import Any

from flywheel.domains.common import task_body, with_recipe

RECIPE: dict[str, Any] | None = {
    "reason": "no truncation gate: the token budget of this domain is a few tokens, so every completion hits it "
              "by design (examples/toy.yaml)"}
"""An explicit opt-out of the verifier's default truncation gate, with its reason (the verifier service's
recipe for the domain still applies when it has one; ``shared.verifier_specs.Recipe.opts_out``)."""

LEVELS: tuple[str, ...] = ("^[a-z]", "^[a-z]{2}", "^[a-z]{3}")
"""Patterns of the difficulty levels, easiest first: the completion starts with 1, 2, 3 lowercase letters."""

_GOLD_CANDIDATES = tuple(string.ascii_lowercase[:k] for k in range(1, 9)) + (
    "yes", "no", "the answer", "hello world", "0", "1", "42", "A", "Hello", "OK")
"""Completions tried, in order, for a gold of a pattern: the first that matches is the gold."""

_WRONG_CANDIDATES = ("7", "", " ", "7a", "A7", "#", "a", "ab", "abc")
"""Completions tried, in order, for a wrong answer when the gold with its last character changed still
matches."""


def _matches(pattern: str, completion: str) -> bool:
    import regex

    return regex.search(pattern, completion, timeout=1.0) is not None


def example(pattern: str) -> str | None:
    """The shortest of a few plain completions (``a``, ``ab``, …, ``yes``, ``42``, …) that ``pattern``
    matches, or None when none does.

    Raises:
        ValueError: ``pattern`` does not compile (the ``regex`` package).
    """
    import regex

    try:
        regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"invalid regular expression {pattern!r}: {e}") from e
    return next((c for c in _GOLD_CANDIDATES if _matches(pattern, c)), None)


def make(n: int, seed: int = 0, split: str = "train", pattern: str = LEVELS[0], samples_per_task: int = 8,
         recipe: dict[str, Any] | None = RECIPE, system_prompt: str | None = None) -> list[dict]:
    """``n`` tasks whose completion must match ``pattern`` (the same seed, split and pattern give the same
    tasks; the task ids differ between patterns). Each carries ``recipe`` when one is given (default
    :data:`RECIPE`: none) and ``system_prompt`` as its system message when one is given. The metadata
    holds the pattern and a gold completion (:func:`example`; None when no simple one matches).

    Raises:
        ValueError: ``pattern`` does not compile, or ``recipe`` is not a valid recipe.
    """
    gold_completion = example(pattern)
    verifier = with_recipe({"kind": "regex", "pattern": pattern}, recipe)
    rng = random.Random(f"toy:{split}:{seed}")
    out = []
    for i in range(n):
        q = "".join(rng.choice("0123456789") for _ in range(4)) + f"{split[0]}{i}"
        out.append(task_body("toy", split, f"{pattern}:{seed}:{i}:{q}", q, dict(verifier), system=system_prompt,
                             samples_per_task=samples_per_task,
                             metadata={"pattern": pattern, "gold": gold_completion}))
    return out


def gold(task: dict) -> str:
    """A completion that matches the task's pattern (recorded by :func:`make`).

    Raises:
        ValueError: no simple completion matches the pattern (none was recorded).
    """
    g = task["metadata"].get("gold")
    if g is None:
        raise ValueError(f"no gold completion known for pattern {task['verifier']['pattern']!r}")
    return g


def corrupt(task: dict, rng: random.Random) -> str:
    """A completion that does not match: the gold with its last character made a digit (one letter
    short of ``^[a-z]{3}``), else the first of a few plain completions that does not match.

    Raises:
        ValueError: the pattern matches every candidate.
    """
    pattern = task["verifier"]["pattern"]
    g = task["metadata"].get("gold") or ""
    for c in (g[:-1] + str(rng.randint(0, 9)) if g else None, *_WRONG_CANDIDATES):
        if c is not None and not _matches(pattern, c):
            return c
    raise ValueError(f"pattern {pattern!r} matches every wrong candidate")
