"""Which training tasks get the next groups: the mix over domains, then the task within a domain.

One :meth:`IssuePlanner.plan` call makes the decisions of one sampler pass: the issuable domains
(active, not paused, weight > 0, under budget, with a live task at their level) share the pass's groups
by :class:`scheduler_service.mix.StrideMix`; within a domain the task with the fewest groups goes first
(ties in a random order drawn anew at every issue, so every epoch differs); the group's samples come
from the domain (``samples_per_task``, ``adaptive_samples``) or the task. Generator domains whose level
has no live task left are reported in :attr:`IssuePlanner.starved` so :class:`TaskMaker` can make some.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from scheduler_service.config import SchedulerSettings
from scheduler_service.domains import COST_KEYS, DomainRow, samples_for, spent_on
from scheduler_service.generate import make_tasks
from scheduler_service.mix import StrideMix
from scheduler_service.registry import Registry
from shared.schemas import Task

log = logging.getLogger(__name__)

_BUDGET_KEYS = ("samples",) + COST_KEYS
_SPEND_EVERY_S = 1.0

TOKEN_SECONDS = 1e-3
"""Nominal generation seconds per token in the work estimate of a group (a CPU engine's order of magnitude;
only the ratio between domains matters)."""


def work_per_group(train: dict[str, float]) -> float | None:
    """Seconds of work of one training group of a domain from its spend (``None`` before a group completed)."""
    if not train.get("groups"):
        return None
    work = sum(train.get(k, 0.0) for k in ("tool_seconds", "sandbox_seconds", "verify_seconds"))
    return (work + TOKEN_SECONDS * train.get("generated_tokens", 0.0)) / train["groups"]


@dataclass
class DomainView:
    """What one pass knows of a domain's spend: training spend, samples in flight, cost per group."""

    spent: dict[str, float] = field(default_factory=dict)
    in_flight_samples: int = 0
    seconds_per_group: float | None = None
    """Wall seconds from issue to the last reward, per completed group (queueing included)."""
    work_per_group: float | None = None
    """Seconds of work per group: tool, sandbox and verifier seconds of its samples plus
    :data:`TOKEN_SECONDS` per generated token (what the cost order compares; queueing excluded)."""


class IssuePlanner:
    """Mix and task choice of one scheduler process (in memory; rebuilt from the registry on restart).

    Args:
        config: the scheduler's settings (``scheduler.issue_order``, ``scheduler.cost_lookahead``).
        registry: the opened registry.
    """

    def __init__(self, config: SchedulerSettings, registry: Registry) -> None:
        self.cfg = config
        self.registry = registry
        self.mix = StrideMix(config.scheduler.cost_lookahead)
        self.starved: set[str] = set()
        """Issuable domains with no live training task at their level in the last pass."""
        self.over_budget: dict[str, str] = {}
        """Domains stopped by a budget cap, with the cap that binds."""
        self.room: dict[str, float] = {}
        """Training samples each capped domain may still be issued in this pass."""
        self.blocked: set[str] = set()
        """Domains whose circuit breaker is not closed (kept by ``scheduler_service.guard.DriftGuard``)."""
        self._views: dict[str, DomainView] = {}
        self._views_at = 0.0

    def views(self, fresh: bool = False) -> dict[str, DomainView]:
        """Per-domain spend and cost per group (re-read at most once a second unless ``fresh``)."""
        if fresh or time.monotonic() - self._views_at > _SPEND_EVERY_S:
            spend = self.registry.spend()
            flight = self.registry.in_flight_by_domain()
            views = {}
            for d in set(spend) | set(flight):
                tr = spend.get(d, {}).get("train", {})
                groups = tr.get("groups", 0)
                views[d] = DomainView({k: tr.get(k, 0.0) for k in _BUDGET_KEYS}, flight.get(d, (0, 0))[1],
                                      tr["group_seconds"] / groups if groups else None, work_per_group(tr))
            self._views, self._views_at = views, time.monotonic()
        return self._views

    def _room(self, row: DomainRow, view: DomainView | None) -> tuple[float, str | None]:
        """Training samples ``row`` may still be issued under its caps (spent plus in-flight samples at
        the cost per sample so far), and the cap that binds first (``inf, None`` without caps)."""
        caps = row.config.budget.model_dump(exclude_none=True)
        view = view or DomainView()
        samples = view.spent.get("samples", 0.0)
        room, why = float("inf"), None
        for key, cap in caps.items():
            spent = spent_on(key, view.spent)
            per_sample = 1.0 if key == "samples" else (spent / samples if samples else 0.0)
            left = (cap - spent) / per_sample - view.in_flight_samples if per_sample > 0 else (
                float("inf") if spent < cap else 0.0)
            if left < room:
                room, why = left, f"{key} {spent:g} of {cap:g}"
        return room, why

    def issuable(self) -> dict[str, DomainRow]:
        """Domains that may get training groups now: active, not paused, breaker closed, weight > 0, under
        budget (:attr:`room` holds the samples each capped one may still get)."""
        rows = {d: r for d, r in self.registry.domain_rows().items() if r.issuable and d not in self.blocked}
        capped = [r for r in rows.values() if r.config.budget.model_dump(exclude_none=True)]
        self.over_budget, self.room = {}, {}
        if capped:
            views = self.views(fresh=True)
            for r in capped:
                room, why = self._room(r, views.get(r.name))
                if room <= 0:
                    self.over_budget[r.name] = why
                    del rows[r.name]
                else:
                    self.room[r.name] = room
        return rows

    def plan(self, budget: int) -> list[tuple[str, int | None]]:
        """Up to ``budget`` ``(task_id, samples or None)`` for new training groups, in issue order.

        A domain's next tasks are read when the mix first picks it in the pass (fewest groups first); a
        domain with fewer live tasks than its share of the pass gets them again (another group of the same
        task), so its share does not depend on its pool size. :attr:`starved` names the domains that had
        no live task.
        """
        rows = self.issuable()
        self.starved = set()
        if budget <= 0 or not rows:
            return []
        weights = {d: r.config.weight for d, r in rows.items()}
        self.mix.set_weights(weights)
        self.mix.start(rows)
        total = sum(weights.values())
        cost = self._costs(set(rows)) if self.cfg.scheduler.issue_order == "cost" else None
        slack = 2 + (self.cfg.scheduler.cost_lookahead if cost else 0)
        cands: dict[str, list[tuple[str, int, int]]] = {}
        cycle: dict[str, list[tuple[str, int, int]]] = {}
        picks: list[tuple[str, int | None]] = []
        while len(picks) < budget:
            d = self.mix.choose(cost=cost)
            if d is None:
                break
            if d not in cands:  # first pick of d in this pass: its share of the pass, and a little more
                k = math.ceil((budget - len(picks)) * weights[d] / total) + slack
                cands[d] = self.registry.next_train_tasks({d: (rows[d].config.level, k)})[d]
                if len(cands[d]) < k:  # every live task of d: a second round of them if its share needs it
                    cycle[d] = list(cands[d])
            if not cands[d]:
                self.starved.add(d)
                self.mix.drop(d)
                continue
            self.mix.take(d)
            tid, samples, passes = cands[d].pop(0)
            if not cands[d] and d in cycle:
                cands[d] = list(cycle[d])
            adaptive = rows[d].config.adaptive_samples
            n = samples_for(samples, passes, adaptive) if adaptive else None
            picks.append((tid, n))
            if d in self.room:  # a capped domain: its group's samples come off what it may still get
                self.room[d] -= n or self.registry.samples_of(tid)
            if not cands[d] or self.room.get(d, 1.0) <= 0:
                self.mix.drop(d)
        return picks

    def stall_reasons(self, making: set[str] | frozenset[str] = frozenset(),
                      failed: set[str] | frozenset[str] = frozenset()) -> dict[str, str] | None:
        """Why no domain can get training groups, per domain, when none of the reasons passes by itself; None when
        some domain may still issue or is only waiting (its breaker's probe decides, a generator in ``making``
        can still make tasks, or the last :meth:`plan` did not look at it). ``failed``: generator domains whose
        generator raised. Call after a :meth:`plan` that picked nothing.

        The reasons: ``retired``, ``paused`` (with the verifier's or an operator's reason), ``weight 0``, ``over
        budget`` (the cap that binds), ``no live training task at level L`` (with how many are retired; for a
        generator domain, that it ran dry or failed)."""
        rows = self.registry.domain_rows()
        summary = self.registry.task_summary()
        out: dict[str, str] = {}
        for d, r in sorted(rows.items()):
            s = summary.get(d, {})
            if not s.get("train"):
                continue  # an evaluation-only domain never had training work
            c = r.config
            if c.state != "active":
                out[d] = c.state
            elif r.pause_reason is not None:
                out[d] = f"paused: {r.pause_reason}"
            elif c.weight <= 0:
                out[d] = "weight 0"
            elif d in self.blocked or d in making:
                return None  # waiting: a probe, or a generator, decides
            elif d in self.over_budget:
                out[d] = f"over budget ({self.over_budget[d]})"
            elif d in self.starved:
                live = sum(s.get("live_by_level", {}).values())
                why = f"no live training task at level {c.level} ({s.get('retired', 0)} of {s['train']} retired"
                why += f", {live} live at other levels)" if live else ")"
                if c.makes_tasks:
                    source = "environment" if c.environment else "generator"
                    why += f", and its {source} " + ("failed (see the scheduler's log)" if d in failed
                                                     else "ran dry" if c.generator else "has no row left at the level")
                out[d] = why
            else:
                return None
        return out or None

    def _costs(self, domains: set[str]) -> dict[str, float] | None:
        """Expected seconds of work of one group per domain (:func:`work_per_group`: tool, sandbox and
        verifier seconds plus generation, not the time spent queueing behind other groups); a domain not
        measured yet counts as the mean of the measured ones. ``None`` while nothing is measured (then
        strict fair order)."""
        views = self.views()
        known = {d: views[d].work_per_group for d in domains if d in views and views[d].work_per_group}
        if not known:
            return None
        mean = sum(known.values()) / len(known)
        return {d: known.get(d, mean) for d in domains}


class TaskMaker:
    """Makes the tasks of generator domains: ``eval_size`` held-out tasks once, and ``tasks_per_level``
    training tasks at a level when the domain has no live task there. Generation runs in a worker thread,
    one domain at a time; new tasks are registered (at their level) and returned for publishing.

    Args:
        config: the scheduler's settings (``scheduler.seed`` seeds the batches).
        registry: the opened registry.
    """

    def __init__(self, config: SchedulerSettings, registry: Registry) -> None:
        self.cfg = config
        self.registry = registry
        self.failed: dict[str, str] = {}
        """Domains whose generator failed, with the error (retried when their config changes)."""

    def needs(self, row: DomainRow, starved: bool) -> list[tuple[str, int]]:
        """``(split, level)`` batches ``row`` needs now: its held-out set when not made yet, and training
        tasks at its level when ``starved`` (no live task) and the generator has not run dry there."""
        c = row.config
        if not c.makes_tasks or self.failed.get(row.name) == row.config.model_dump_json():
            return []
        out = []
        if c.eval_size and f"eval:{c.eval_level}" not in row.batches:
            out.append(("eval", c.eval_level))
        if starved and row.batches.get(f"train:{c.level}", 0) >= 0:
            out.append(("train", c.level))
        return out

    def make(self, row: DomainRow, split: str, level: int) -> list[Task]:
        """Generate and register one batch (blocking: call in a thread). Returns the tasks stored now.

        A batch that adds nothing new marks the level dry (no more batches there); a generator error is
        logged and remembered in :attr:`failed` until the domain's config changes.
        """
        c = row.config
        key = f"{split}:{level}"
        batch = max(row.batches.get(key, 0), 0)
        n = c.eval_size if split == "eval" else c.tasks_per_level
        try:
            tasks = make_tasks(row.name, c, level, n, split, batch, self.cfg.scheduler.seed)
        except ValueError as e:
            log.error("domain %s: %s", row.name, e)
            self.failed[row.name] = c.model_dump_json()
            return []
        reg = self.registry.register(tasks, level=level)
        self.registry.record_batch(row.name, key, len(reg.new))
        log.info("domain %s: generated %d %s tasks at level %d (%d new, %d duplicates)", row.name, len(tasks),
                 split, level, len(reg.new), len(reg.duplicates))
        return reg.new

    async def run_needed(self, starved: set[str]) -> list[Task]:
        """Every batch the issuable-or-evaluated domains need now (see :meth:`needs`), in a thread."""
        out: list[Task] = []
        for row in self.registry.domain_rows().values():
            if row.config.state == "retired":
                continue
            for split, level in self.needs(row, row.name in starved):
                out += await asyncio.to_thread(self.make, row, split, level)
        return out
