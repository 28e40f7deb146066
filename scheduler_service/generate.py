"""Tasks of generator-backed domains, made by the scheduler on demand.

A domain's ``generator`` names ``module`` or ``module:function`` (default ``make``) with the signature
of the shipped domain modules: ``make(n, seed=..., split=..., **params) -> list[dict]`` of task bodies.
It is loaded with importlib when first needed, like verl's ``custom_reward_function.path``: the
scheduler imports no generator at start-up, and a user's own module works the same as the shipped
``flywheel.domains.*``.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from scheduler_service.config import DomainConfig
from shared.schemas import Task

Generator = Callable[..., list[dict[str, Any]]]


def load_generator(ref: str) -> Generator:
    """The callable named by ``ref`` (``module`` or ``module:function``).

    Raises:
        ValueError: the module cannot be imported or has no such callable.
    """
    module, _, name = ref.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module itself failing at import
        raise ValueError(f"cannot import generator module {module!r}: {e!r}") from None
    fn = getattr(mod, name or "make", None)
    if not callable(fn):
        raise ValueError(f"generator module {module!r} has no callable {name or 'make'!r}")
    return fn


def batch_seed(seed: int, domain: str, split: str, level: int, batch: int) -> int:
    """A generator seed per (domain, split, level, batch): distinct batches give distinct items."""
    h = hashlib.sha1(f"{seed}:{domain}:{split}:{level}:{batch}".encode()).digest()
    return int.from_bytes(h[:4], "big")


def make_tasks(domain: str, cfg: DomainConfig, level: int, n: int, split: str, batch: int,
               seed: int = 0) -> list[Task]:
    """``n`` tasks of ``domain`` at ``level`` from its generator (batch ``batch`` of that level).

    Every body's ``domain`` becomes ``domain``, its id ``<domain>.<split>.L<level>.<the generator's id>``,
    its ``difficulty`` the level index; the domain's ``samples_per_task`` (when set) replaces the task's.

    Raises:
        ValueError: no generator, the generator fails on the level's params, or a body is not a valid
            task (the message names the field).
    """
    if cfg.generator is None:
        raise ValueError(f"domain {domain!r} has no generator")
    fn = load_generator(cfg.generator)
    params = cfg.level_params(level)
    try:
        bodies = fn(n, seed=batch_seed(seed, domain, split, level, batch), split=split, **params)
    except Exception as e:  # TypeError (unknown keyword), ValueError, the generator's own errors
        raise ValueError(f"generator {cfg.generator} failed at level {level} with {params}: {e!r}") from None
    out = []
    for b in bodies:
        b = dict(b, domain=domain, split=split, difficulty=float(level))
        b["task_id"] = f"{domain}.{split}.L{level}.{b.get('task_id') or len(out)}"
        if cfg.samples_per_task:
            b["samples_per_task"] = cfg.samples_per_task
        try:
            out.append(Task(**b))
        except ValidationError as e:
            er = e.errors()[0]
            raise ValueError(f"generator {cfg.generator} made an invalid task: "
                             f"{'.'.join(map(str, er['loc']))}: {er['msg']}") from None
    return out


def check_levels(domain: str, cfg: DomainConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Try the generator once per level (one task each); the problems as ``(field path, message)``
    (empty when every level builds). Without a generator there is nothing to try."""
    if cfg.generator is None:
        return []
    try:
        load_generator(cfg.generator)
    except ValueError as e:
        return [(("generator",), str(e))]
    problems = []
    for i in range(len(cfg.levels or [None])):
        try:
            if not make_tasks(domain, cfg, i, 1, "train", 0):
                problems.append((("levels", i, "params") if cfg.levels else ("params",), "the generator made no task"))
        except ValueError as e:
            problems.append((("levels", i, "params") if cfg.levels else ("params",), str(e)))
    return problems
