"""Tasks of generator-backed domains, made by the scheduler on demand.

A domain's ``generator`` names ``module`` or ``module:function`` (default ``make``) with the signature
of the shipped domain modules: ``make(n, seed=..., split=..., **params) -> list[dict]`` of task bodies.
It is loaded with importlib when first needed, like verl's ``custom_reward_function.path``: the
scheduler imports no generator at start-up, and a user's own module works the same as the shipped
``flywheel.domains.*``.

A domain with an ``environment`` is made the same way from the environment's dataset rows: batch ``b`` of a level is the level's training rows
``[b·n, (b+1)·n)``, so the level runs dry once its rows are used; the tasks are those of
:func:`shared.envs.tasks.row_task`, as ``flywheel run`` makes them from ``tasks.kind: environment``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import math
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from scheduler_service.config import DomainConfig
from shared.envs.api import Environment
from shared.envs.loading import EnvironmentLoadError, EnvironmentRef, load_environment
from shared.envs.tasks import row_task, split_rows
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
    if cfg.environment is not None:
        return environment_tasks(domain, cfg, level, n, split, batch, seed)
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
        out.append(_task(b, f"generator {cfg.generator} made an invalid task"))
    return out


def _task(body: dict[str, Any], what: str) -> Task:
    """``body`` as a :class:`Task`.

    Raises:
        ValueError: ``body`` is not a valid task: ``what``, then the first field and its error.
    """
    try:
        return Task(**body)
    except ValidationError as e:
        er = e.errors()[0]
        raise ValueError(f"{what}: {'.'.join(map(str, er['loc']))}: {er['msg']}") from None


def check_levels(domain: str, cfg: DomainConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Try the generator once per level (one task each); the problems as ``(field path, message)``
    (empty when every level builds). Without a generator there is nothing to try; an environment domain is
    checked by :func:`check_environment`."""
    if cfg.environment is not None:
        return check_environment(domain, cfg)
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


# ------------------------------------------------------------ environment domains

EnvironmentRows = tuple[EnvironmentRef, Environment, list[dict], list[list[dict]]]
"""``(resolved reference, environment, held-out rows, training rows per level)``."""


def _difficulty(row: dict[str, Any], strict: bool, where: str) -> float:
    """A row's ``difficulty`` column as a number (0.0 when absent).

    Raises:
        ValueError: (``strict`` only) the value is not a finite number within ±1e9 (the message names ``where``);
            not strict, such a value counts as 0.0.
    """
    v = row.get("difficulty")
    if v is None:
        return 0.0
    try:
        x = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if math.isfinite(x) and abs(x) <= 1e9:
        return x
    if strict:
        raise ValueError(f"{where}: difficulty {str(v)[:80]!r} is not a number within ±1e9 (the levels' "
                         "difficulty ranges need one)")
    return 0.0


Ranges = tuple[tuple[float, float], ...] | None
"""The difficulty range of each level of an environment domain (``None``: no levels, one level of every row)."""


def _level_rows(ranges: Ranges, train: list[dict]) -> list[list[dict]]:
    """The training rows of each level: all of them at level 0 without levels, else those whose difficulty is
    in the level's range (the first that holds it; a row in none is never issued).

    Raises:
        ValueError: with levels, a row whose difficulty is not a number.
    """
    if not ranges:
        return [train]
    out: list[list[dict]] = [[] for _ in ranges]
    for i, row in enumerate(train):
        d = _difficulty(row, True, f"training row {i}")
        for (lo, hi), rows in zip(ranges, out):
            if lo <= d <= hi:
                rows.append(row)
                break
    return out


@functools.lru_cache(maxsize=4)
def _load_rows(ref_key: str, eval_size: int, seed: int, ranges: Ranges) -> EnvironmentRows:
    ref = EnvironmentRef.model_validate_json(ref_key).resolved()
    env = load_environment(ref)
    held, train = split_rows(env, eval_size, seed)
    return ref, env, held, _level_rows(ranges, train)


def environment_rows(cfg: DomainConfig, seed: int, cached: bool = True) -> EnvironmentRows:
    """The environment's rows as the domain issues them (see :data:`EnvironmentRows`), read once per process and
    (reference, ``eval_size``, ``seed``, levels) unless not ``cached``.

    Raises:
        shared.envs.EnvironmentLoadError: the environment cannot be imported or built.
        shared.envs.DatasetError: a dataset cannot be read, or a row lacks its prompt or a mapped column.
        ValueError: with levels, a row whose difficulty is not a number.
    """
    ranges = tuple(tuple(lv.difficulty) for lv in cfg.levels) if cfg.levels else None
    load = _load_rows if cached else _load_rows.__wrapped__
    return load(cfg.environment.key(), cfg.eval_size, seed, ranges)


def _as_tasks(domain: str, cfg: DomainConfig, ref: EnvironmentRef, env: Environment, rows: list[dict],
              split: str) -> list[Task]:
    """Tasks of ``rows`` (each row's difficulty kept; the domain's ``samples_per_task`` when set).

    Raises:
        ValueError: a row makes an invalid task (the message names the field).
    """
    out = []
    for row in rows:
        body = row_task(ref, env, domain, row, split, cfg.samples_per_task,
                        difficulty=_difficulty(row, False, "row"))
        out.append(_task(body, f"environment {ref.label()}: a row makes an invalid task {body['task_id']}"))
    return out


def environment_tasks(domain: str, cfg: DomainConfig, level: int, n: int, split: str, batch: int,
                      seed: int = 0) -> list[Task]:
    """Batch ``batch`` of ``n`` tasks of environment domain ``domain`` at ``level``: its held-out rows for
    ``eval`` (batch 0 only), else the level's training rows ``[batch·n, (batch+1)·n)`` (none once they run out).

    Raises:
        ValueError: the environment cannot be loaded, its dataset read, or a row made a task (the message says
            which: :class:`~shared.envs.EnvironmentLoadError` and :class:`~shared.envs.DatasetError` are
            ValueErrors).
    """
    try:
        ref, env, held, levels = environment_rows(cfg, seed)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code and data: a failed batch, not a crashed maker
        raise ValueError(f"environment {cfg.environment.label()[:300]} cannot be loaded: {type(e).__name__}: "
                         f"{str(e)[:500]}") from e
    if split == "eval":
        rows = held[:n] if batch == 0 else []
    else:
        rows = levels[level][batch * n:(batch + 1) * n] if level < len(levels) else []
    return _as_tasks(domain, cfg, ref, env, rows, split)


def check_environment(domain: str, cfg: DomainConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Load an environment domain's environment and rows afresh (and forget the rows read before), and make one
    task per level and one held-out task; the problems as ``(field path, message)``: ``environment`` when it
    cannot be imported or built (the message names the id, module, file or attribute), or its dataset cannot be
    read or lacks a column (the message names the column and the columns present); ``eval_size`` when the
    held-out rows leave no training row; ``levels.<i>.difficulty`` when no row is in a level's range."""
    if cfg.environment is None:
        return []
    where = ("environment",)
    try:
        ref, env, held, levels = environment_rows(cfg, 0, cached=False)
    except EnvironmentLoadError as e:  # names the reference already
        return [(where, str(e))]
    except ValueError as e:  # DatasetError, a difficulty that is no number
        return [(where, f"environment {cfg.environment.label()[:300]}: {e}")]
    except Exception as e:  # noqa: BLE001 - the user's code and data: whatever fails, the answer is a 422
        return [(where, f"environment {cfg.environment.label()[:300]} cannot be loaded: {type(e).__name__}: "
                        f"{str(e)[:500]}")]
    _load_rows.cache_clear()
    if not cfg.levels and not levels[0]:  # with levels, each empty level is named below
        drawn = held and env.eval_dataset is None
        why = (f"the {len(held)} held-out rows (eval_size) are all its rows" if drawn else
               "its dataset has no row whose prompt is not held out")
        return [(("eval_size",) if drawn else where, f"environment {ref.label()}: no training row: {why}")]
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for i, rows in enumerate(levels):
        if cfg.levels and not rows:
            problems.append((("levels", i, "difficulty"), f"no training row of environment {ref.label()} has a "
                                                          f"difficulty in {list(cfg.levels[i].difficulty)}"))
    try:
        for rows, split in [(r[:1], "train") for r in levels] + [(held[:1], "eval")]:
            _as_tasks(domain, cfg, ref, env, rows, split)
    except ValueError as e:
        problems.append((where, str(e)))
    return problems
