"""Helpers shared by the task generators."""

from __future__ import annotations

import hashlib
from typing import Any

ANSWER_TAG_SYSTEM = ("Solve the problem. You may reason first, then give only the final answer inside "
                     "<answer></answer> tags.")


TRUNCATION_GATE: dict[str, Any] = {"rules": [{"rule": "truncation"}], "gates": ["truncation"]}
"""The recipe of domains whose answer is the end of a finished response (math, reasoning): a completion
cut off at the token budget (finish_reason ``length``) earns 0, whatever number it holds."""


def with_recipe(verifier: dict[str, Any], recipe: dict[str, Any] | None) -> dict[str, Any]:
    """``verifier`` carrying ``recipe`` as its ``recipe`` (``None``: none, so the verifier service's
    recipe for the task's domain applies).

    Raises:
        ValueError: ``recipe`` is not a valid recipe (``shared.verifier_specs.Recipe``).
    """
    if recipe is None:
        return verifier
    from shared.verifier_specs import Recipe

    Recipe.model_validate(recipe)  # a bad recipe fails here, not when the scheduler receives the task
    return {**verifier, "recipe": recipe}


def task_id(domain: str, split: str, key: str) -> str:
    """A stable task id: ``<domain>-<split>-<12 hex of sha1(key)>``."""
    return f"{domain}-{split}-{hashlib.sha1(f'{domain}:{key}'.encode()).hexdigest()[:12]}"


def task_body(domain: str, split: str, key: str, user: str, verifier: dict[str, Any], *,
              system: str | None = None, samples_per_task: int = 8, difficulty: float = 0.0,
              metadata: dict[str, Any] | None = None, tools: list[str] | None = None,
              max_turns: int = 1) -> dict[str, Any]:
    """One task body for ``POST /v1/tasks`` (id from ``key``, chat prompt of an optional system message
    and one user message)."""
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    body = {"task_id": task_id(domain, split, key), "domain": domain, "prompt": prompt, "verifier": verifier,
            "samples_per_task": samples_per_task, "difficulty": difficulty, "split": split,
            "metadata": metadata or {}}
    if tools:
        body["tools"] = tools
        body["max_turns"] = max_turns
    return body


def split_seed(seed: int, split: str) -> int:
    """Generator seed of a split: the eval split draws from a far-away seed (disjoint items)."""
    return seed if split == "train" else seed + 1_000_003
