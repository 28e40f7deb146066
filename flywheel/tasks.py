"""Task sources of ``flywheel run``: reasoning-gym items, the shipped domains, or a user's environment, as
Flywheel tasks split into train and held-out.

Held-out items are disjoint from training items by normalised prompt text (DESIGN.md).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.envs import EnvironmentRef
from shared.envs.tasks import environment_name, row_task, split_rows
from shared.envs.tasks import norm_text as _norm
from shared.verifier_specs import Recipe


class DomainSource(BaseModel):
    """One shipped domain of a ``mixture`` (``flywheel.domains``): how many tasks of each split, and the
    generator's parameters."""

    model_config = ConfigDict(extra="forbid")
    domain: Literal["reasoning_gym", "humaneval", "humaneval_repair", "gsm_symbolic", "financial_extraction",
                    "geometry"]
    train_size: int = Field(64, ge=0, le=1_000_000)
    eval_size: int = Field(16, ge=0, le=100_000)
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the domain's ``make`` (e.g. ``datasets`` for reasoning_gym)."""


class TaskSourceConfig(BaseModel):
    """What ``flywheel run`` submits. Env names: ``FLYWHEEL_TASKS__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reasoning_gym", "toy_prefix", "mixture", "environment", "none"] = "reasoning_gym"
    """``reasoning_gym`` (a dataset with its scorer), ``toy_prefix`` (reward 1 when the completion starts
    like ``toy_pattern``: a domain a tiny random model learns in seconds), ``mixture`` (shipped domains),
    ``environment`` (a user's environment: its dataset and rubric, docs/guides/environments.md), or ``none``."""
    environment: EnvironmentRef | None = None
    """``environment``: which one, ``{id | module | path, args}``. Its dataset gives at most ``train_size``
    training and ``eval_size`` held-out tasks (held-out from its ``eval_dataset`` when it has one, else drawn
    from the dataset and kept disjoint by prompt); its ``system_prompt`` replaces :attr:`system_prompt`."""
    dataset: str = "basic_arithmetic"
    """reasoning-gym dataset name."""
    dataset_config: dict[str, Any] = Field(default_factory=lambda: {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
        "allow_negation": False, "allow_parentheses": False})
    """Keyword arguments of the dataset's config (difficulty knobs)."""
    train_size: int = Field(128, ge=1, le=1_000_000)
    """Training tasks submitted."""
    eval_size: int = Field(64, ge=0, le=100_000)
    """Held-out tasks (greedy, one sample each)."""
    samples_per_task: int = Field(8, ge=2, le=1024)
    """K: samples per group."""
    system_prompt: str | None = "Answer with only the final number."
    """System message of every task."""
    extract: Literal["last_number", "answer_tag", "boxed", "full"] = "last_number"
    """Answer extraction of the reasoning_gym verifier."""
    domains: list[DomainSource] = Field(default_factory=list)
    """``mixture``: the shipped domains to submit; the scheduler samples them like any tasks."""
    toy_pattern: str = "^[a-z]"
    """Regex the completion must match in the ``toy_prefix`` domain (default: starts with a lowercase letter)."""
    recipe: Recipe | None = None
    """Verifier recipe every ``reasoning_gym`` and ``toy_prefix`` task carries. ``null`` (the default): none, so
    the verifier service's recipe for the domain applies, else its safe default: a completion cut off at the
    token budget (finish_reason ``length``) earns 0 and a detected hack earns 0. To score cut-off answers like
    any other, opt out with a reason: ``{reason: "no truncation gate: ..."}``. ``mixture`` domains take theirs
    from ``domains[].params.recipe`` (``flywheel.domains``)."""
    seed: int = 0
    """Seed of the generator."""


def _task(task_id: str, domain: str, question: str, verifier: dict, cfg: TaskSourceConfig, split: str,
          difficulty: float = 0.0, metadata: dict | None = None) -> dict:
    prompt = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + [
        {"role": "user", "content": question}]
    if cfg.recipe is not None:
        verifier = {**verifier, "recipe": cfg.recipe.model_dump(mode="json", exclude_none=True)}
    return {"task_id": task_id, "domain": domain, "prompt": prompt, "verifier": verifier,
            "samples_per_task": cfg.samples_per_task, "difficulty": difficulty, "split": split,
            "metadata": metadata or {}}


def make_tasks(cfg: TaskSourceConfig) -> list[dict]:
    """Task bodies for ``POST /v1/tasks``: ``eval_size`` held-out items, then ``train_size`` training ones.

    Raises:
        ValueError: the generator cannot produce enough distinct items.
    """
    if cfg.kind == "none":
        return []
    if cfg.kind == "mixture":
        return _mixture_tasks(cfg)
    if cfg.kind == "toy_prefix":
        return _toy_tasks(cfg)
    if cfg.kind == "environment":
        return environment_tasks(cfg)
    import reasoning_gym

    seen: set[str] = set()
    out: list[dict] = []
    for split, size, seed in (("eval", cfg.eval_size, cfg.seed + 1_000_003), ("train", cfg.train_size, cfg.seed)):
        if size == 0:
            continue
        ds = reasoning_gym.create_dataset(cfg.dataset, size=size * 4 + 64, seed=seed, **cfg.dataset_config)
        n = 0
        for entry in ds:
            key = _norm(entry["question"])
            if key in seen:
                continue
            seen.add(key)
            digest = hashlib.sha1(f"{cfg.dataset}:{key}".encode()).hexdigest()[:12]
            entry = {"question": entry["question"], "answer": entry["answer"], "metadata": entry.get("metadata", {})}
            verifier = {"kind": "reasoning_gym", "dataset": cfg.dataset, "entry": entry, "extract": cfg.extract}
            out.append(_task(f"{cfg.dataset}-{split}-{digest}", cfg.dataset, entry["question"], verifier, cfg, split,
                             metadata={"answer": entry["answer"]}))
            n += 1
            if n == size:
                break
        if n < size:
            raise ValueError(f"{cfg.dataset}: only {n} distinct {split} items for {size} asked")
    return out


def _toy_tasks(cfg: TaskSourceConfig) -> list[dict]:
    import random

    rng = random.Random(cfg.seed)
    out = []
    for split, size in (("eval", cfg.eval_size), ("train", cfg.train_size)):
        for i in range(size):
            q = "".join(rng.choice("0123456789") for _ in range(4)) + f"{split[0]}{i}"
            verifier = {"kind": "regex", "pattern": cfg.toy_pattern}
            out.append(_task(f"toy-{split}-{i}", "toy_prefix", q, verifier, cfg, split))
    return out


def _mixture_tasks(cfg: TaskSourceConfig) -> list[dict]:
    """Every domain's held-out tasks, then its training tasks less any whose prompt is held out.

    Raises:
        ValueError: ``domains`` is empty, or a generator rejects its parameters.
    """
    from flywheel.domains import make_tasks as make_domain_tasks

    if not cfg.domains:
        raise ValueError("tasks.kind mixture needs at least one entry in tasks.domains")
    out: list[dict] = []
    for d in cfg.domains:
        params = {"samples_per_task": cfg.samples_per_task, **d.params}
        held = make_domain_tasks(d.domain, d.eval_size, seed=cfg.seed, split="eval", **params) if d.eval_size else []
        seen = {_norm(t["prompt"][-1]["content"]) for t in held}
        train = make_domain_tasks(d.domain, d.train_size, seed=cfg.seed, split="train", **params) if d.train_size else []
        out += held + [t for t in train if _norm(t["prompt"][-1]["content"]) not in seen]
    return out


def environment_tasks(cfg: TaskSourceConfig) -> list[dict]:
    """The tasks of ``cfg.environment``: held-out ones first, then training ones (see the field's docstring), made
    from its rows by :mod:`shared.envs.tasks` (as the scheduler makes an environment domain's).

    Raises:
        shared.envs.EnvironmentLoadError: the environment cannot be imported or built.
        shared.envs.DatasetError: a dataset cannot be read or a row lacks a prompt or a mapped column.
        ValueError: no ``environment`` given, or no training row left.
    """
    from shared.envs import load_environment

    if cfg.environment is None:
        raise ValueError("tasks.kind environment needs tasks.environment: {id | module | path, args}")
    ref = cfg.environment.resolved()
    env = load_environment(ref)
    name = environment_name(ref, env.name)
    held, train = split_rows(env, cfg.eval_size, cfg.seed)
    train = train[:cfg.train_size]
    if not train:
        if env.eval_dataset is not None:
            why = (f"no row of its dataset has a prompt outside the {len(held)} held-out rows of its eval_dataset "
                   f"(tasks.eval_size {cfg.eval_size})")
        elif len(held) < cfg.eval_size:
            why = (f"tasks.eval_size {cfg.eval_size} asked for more held-out rows than the dataset's {len(held)} "
                   "rows, so all of them are held out; lower tasks.eval_size")
        else:
            why = (f"tasks.eval_size {cfg.eval_size} holds out {len(held)} rows and the dataset's other rows, if "
                   "any, repeat held-out prompts; lower tasks.eval_size")
        raise ValueError(f"environment {name!r}: no training rows left: {why}")
    recipe = cfg.recipe.model_dump(mode="json", exclude_none=True) if cfg.recipe is not None else None
    return [row_task(ref, env, name, row, split, cfg.samples_per_task, recipe)
            for split, part in (("eval", held), ("train", train)) for row in part]
