"""Trajectories of a run from its config alone: the training groups the sampler issues, their share per
domain, the expected re-samples of unsolved groups, and the held-out eval rounds (:func:`plan_counts`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


TRAIN, EVAL = "train", "eval"


def issued_training_groups(batch_groups: int, oversample: float, max_steps: int) -> int:
    """Training groups the sampler issues over a run: ``max_steps × ⌈batch_groups × oversample⌉`` (the
    total cap of :func:`scheduler_service.issue_loop.training_budget` at the last version; re-samples of
    unsolved groups and replacements of dropped ones come on top)."""
    return max_steps * math.ceil(batch_groups * oversample)


def eval_round_versions(max_steps: int, eval_every: int, eval_before_training: bool, has_eval: bool) -> list[int]:
    """Policy versions of the held-out rounds of a ``flywheel run``: 0 when ``eval_before_training``,
    every multiple of ``eval_every`` in ``(0, max_steps]`` (``scheduler.eval_every``; 0 = none), and
    ``max_steps`` (the final round of ``flywheel run``) unless one is there already. Empty without eval tasks."""
    if not has_eval:
        return []
    out = [0] if eval_before_training else []
    if eval_every > 0:
        out += list(range(eval_every, max_steps + 1, eval_every))
    if max_steps not in out:
        out.append(max_steps)
    return out


def unsolved_probability(passes: int, samples: int, k: int) -> float:
    """Estimate of ``(1 − p)^k``, the chance that a group of ``k`` samples of a task with pass rate ``p``
    has no pass, from ``passes`` of ``samples`` pilot samples of the task.

    With ``samples ≥ k`` it is the unbiased ``C(samples − passes, k) / C(samples, k)`` (the share of
    ``k``-subsets of the pilot samples without a pass; the plug-in ``(1 − passes/samples)^k`` would
    overstate it, by Jensen's inequality); with fewer samples, the plug-in.

    Raises:
        ValueError: ``samples < 1``, ``k < 1`` or ``passes`` outside ``[0, samples]``.
    """
    if samples < 1 or k < 1 or not 0 <= passes <= samples:
        raise ValueError(f"need 0 <= passes <= samples, samples >= 1, k >= 1 (got {passes}, {samples}, {k})")
    if samples >= k:
        return math.comb(samples - passes, k) / math.comb(samples, k)
    return (1.0 - passes / samples) ** k


@dataclass
class Counts:
    """Trajectories of one domain over a run, by origin (group counts are expected values: fractional)."""

    train_groups: float
    """Issued training groups (the domain's share of :func:`issued_training_groups`)."""
    samples_per_task: int
    """K of its training groups."""
    resample_groups: float = 0.0
    """Expected re-samples of unsolved groups: ``train_groups × unsolved``."""
    resample_samples: int = 0
    """Samples of one re-sample (``budget.resample_unsolved``; 0 when re-sampling is off or not larger than K)."""
    unsolved: float | None = None
    """Expected share of training groups that come back unsolved (``None``: not known)."""
    eval_tasks: int = 0
    eval_rounds: int = 0

    @property
    def train_samples(self) -> float:
        """Trajectories of the issued groups (re-samples not included)."""
        return self.train_groups * self.samples_per_task

    @property
    def resample_trajectories(self) -> float:
        return self.resample_groups * self.resample_samples

    @property
    def eval_trajectories(self) -> int:
        """Greedy held-out trajectories: one per eval task and round."""
        return self.eval_tasks * self.eval_rounds


def domain_shares(domains: list[str], configured: dict[str, Any]) -> dict[str, float]:
    """Share of the training groups per domain: its weight over the sum (``configured`` are the
    scheduler's ``domains`` entries; an unconfigured domain has weight 1, a paused or retired one 0).

    Raises:
        ValueError: every domain has weight 0.
    """
    weights = {}
    for d in domains:
        dc = configured.get(d)
        state = getattr(dc, "state", "active")
        weights[d] = 0.0 if state != "active" else float(getattr(dc, "weight", 1.0))
    total = sum(weights.values())
    if domains and total <= 0:
        raise ValueError(f"every training domain has weight 0 or is paused: {sorted(domains)}")
    return {d: w / total for d, w in weights.items()} if total else {}


def plan_counts(cfg, tasks: list[dict], unsolved: dict[str, float | None] | None = None) -> dict[str, Counts]:
    """Trajectories per domain of a ``flywheel run`` of ``cfg`` (a ``FlywheelConfig``) submitting ``tasks``
    (task bodies, as :func:`flywheel.tasks.make_tasks`), with ``unsolved[d]`` the expected share of the
    domain's training groups that come back unsolved (missing or ``None``: no re-samples counted).

    Raises:
        ValueError: no domain can take training groups.
    """
    b, sc = cfg.budget, cfg.scheduler
    unsolved = unsolved or {}
    configured = dict(getattr(cfg, "domains", {}) or {})
    train_k: dict[str, int] = {}
    eval_n: dict[str, int] = {}
    for t in tasks:
        d = t["domain"]
        if t.get("split", TRAIN) == EVAL:
            eval_n[d] = eval_n.get(d, 0) + 1
        else:
            train_k.setdefault(d, int(t.get("samples_per_task", cfg.tasks.samples_per_task)))
    for d, dc in configured.items():  # generator domains make their training tasks in the scheduler
        if getattr(dc, "generator", None):
            train_k.setdefault(d, cfg.tasks.samples_per_task)
    for d, dc in configured.items():
        if d in train_k and getattr(dc, "samples_per_task", None):
            train_k[d] = int(dc.samples_per_task)
    groups = issued_training_groups(b.batch_groups, b.oversample, b.max_steps)
    shares = domain_shares(sorted(train_k), configured)
    rounds = len(eval_round_versions(b.max_steps, sc.eval_every, sc.eval_before_training, sum(eval_n.values()) > 0))
    out: dict[str, Counts] = {}
    for d in sorted(set(train_k) | set(eval_n)):
        k = train_k.get(d, cfg.tasks.samples_per_task)
        u = unsolved.get(d)
        n_re = b.resample_unsolved if b.resample_unsolved > k else 0
        g = groups * shares.get(d, 0.0)
        out[d] = Counts(train_groups=g, samples_per_task=k, resample_groups=g * (u or 0.0) if n_re else 0.0,
                        resample_samples=n_re, unsolved=u, eval_tasks=eval_n.get(d, 0),
                        eval_rounds=rounds if eval_n.get(d) else 0)
    return out
