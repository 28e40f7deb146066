"""What feeds the scheduler's Prometheus families (:mod:`scheduler_service.metrics`).

The sampler counts the groups it sent (:func:`count_issued`) and the rewards it recorded (:func:`count_reward`);
the process state registers :class:`StateCollector` (:func:`watch_state`), whose gauges are read from the
registry and the drift guard at scrape time. Kept apart from the metric definitions so the metrics module
imports no service module: the modules that act import it and set values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily

from scheduler_service.group_store import IssuedGroup
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.reward_store import RewardOutcome
from shared.metrics import DomainLabels
from shared.schemas import RewardEvent

if TYPE_CHECKING:
    from scheduler_service.guard import DriftGuard
    from scheduler_service.registry import Registry

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
"""Value of ``flywheel_scheduler_breaker_state`` per breaker state."""
SPEND_RESOURCES = ("samples", "generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls",
                   "verify_seconds", "groups", "group_seconds")
"""Columns of the registry's ``spend`` table shown as ``flywheel_scheduler_budget_spent{resource}``."""


def watch_state(metrics: SchedulerMetrics, registry: "Registry", guard: Callable[[], "DriftGuard"]) -> None:
    """Register the scrape-time gauges over ``registry`` and ``guard()`` (the current drift guard)."""
    metrics.registry.register(StateCollector(registry, guard, metrics.domain))


def count_issued(metrics: SchedulerMetrics, groups: Iterable[IssuedGroup]) -> None:
    """Count groups just sent (attempt 1: issued; later attempts: re-issued)."""
    for g in groups:
        fam = metrics.groups_issued if g.attempt <= 1 else metrics.groups_reissued
        fam.labels(metrics.domain(g.domain), g.purpose).inc()


def count_reward(metrics: SchedulerMetrics, ev: RewardEvent, outcome: RewardOutcome, policy_version: int) -> None:
    """Count one recorded RewardEvent (only what :meth:`Registry.record_reward` counted)."""
    if not outcome.counted:
        return
    d = metrics.domain(ev.domain)
    if outcome.completed:
        metrics.groups_completed.labels(d, ev.purpose).inc()
    if not outcome.scored:
        metrics.infra_errors.labels(d).inc()
        return
    metrics.samples_scored.labels(d, ev.purpose).inc()
    if ev.passed:
        metrics.samples_passed.labels(d, ev.purpose).inc()
    if ev.purpose == "train":
        metrics.staleness.observe(max(0, policy_version - ev.policy_version))


class StateCollector:
    """Gauges read from the registry and the drift monitor at scrape time.

    ``flywheel_scheduler_policy_version``, ``…_in_flight_groups`` and ``…_pending_groups`` (all purposes),
    ``…_breaker_state{domain}`` (0 closed, 1 half-open, 2 open), ``…_budget_spent{domain,purpose,resource}``
    (the registry's ``spend`` table), ``…_budget_cap{domain,resource}`` (the domains' ``budget`` caps),
    ``…_alerts_firing{severity}`` and ``…_training_paused`` (1 while paused run-wide).
    """

    def __init__(self, registry: "Registry", guard: Callable[[], "DriftGuard"], domain: DomainLabels) -> None:
        self.reg, self.guard, self.domain = registry, guard, domain

    def describe(self) -> list[GaugeMetricFamily]:
        """The families, without samples (so registering does not read the database)."""
        return list(self._families())

    def _families(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("flywheel_scheduler_policy_version", "Highest policy version announced on "
                                "flywheel.weights.")
        yield GaugeMetricFamily("flywheel_scheduler_in_flight_groups", "Groups issued and not yet complete.")
        yield GaugeMetricFamily("flywheel_scheduler_pending_groups", "Groups written and waiting to be sent.")
        yield GaugeMetricFamily("flywheel_scheduler_breaker_state", "Circuit breaker per domain: 0 closed, "
                                "1 half-open, 2 open.", labels=["domain"])
        yield GaugeMetricFamily("flywheel_scheduler_budget_spent", "What each domain spent so far, per purpose and "
                                "resource (samples, tokens, seconds, calls).", labels=["domain", "purpose", "resource"])
        yield GaugeMetricFamily("flywheel_scheduler_budget_cap", "A domain's training budget cap per resource.",
                                labels=["domain", "resource"])
        yield GaugeMetricFamily("flywheel_scheduler_alerts_firing", "Alerts firing now, by severity.",
                                labels=["severity"])
        yield GaugeMetricFamily("flywheel_scheduler_training_paused", "1 while training is paused run-wide.")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Read the state now and yield the gauges."""
        version, in_flight, pending, breakers, spent, caps, firing, paused = self._families()
        reg = self.reg
        version.add_metric([], reg.policy_version)
        states = reg.group_state_counts()
        in_flight.add_metric([], states["issued"])
        pending.add_metric([], states["pending"])
        monitor = self.guard().monitor
        worst: dict[str, int] = {}
        for d, b in list(monitor.breakers.items()):
            lab = self.domain(d)
            worst[lab] = max(worst.get(lab, 0), BREAKER_STATES.get(b.state, 2))
        for d in reg.domain_rows():
            worst.setdefault(self.domain(d), 0)
        for lab, v in sorted(worst.items()):
            breakers.add_metric([lab], v)
        sums: dict[tuple[str, str, str], float] = {}
        for d, per in reg.spend().items():
            lab = self.domain(d)
            for purpose, vals in per.items():
                for k in SPEND_RESOURCES:
                    key = (lab, purpose, k)
                    sums[key] = sums.get(key, 0.0) + float(vals.get(k) or 0.0)
        for key, v in sorted(sums.items()):
            spent.add_metric(list(key), v)
        cap_sums: dict[tuple[str, str], float] = {}
        for d, row in reg.domain_rows().items():
            for k, v in row.config.budget.model_dump(exclude_none=True).items():
                key = (self.domain(d), k)
                cap_sums[key] = cap_sums.get(key, 0.0) + float(v)
        for key, v in sorted(cap_sums.items()):
            caps.add_metric(list(key), v)
        count = {"critical": 0, "warning": 0, "info": 0}
        for a in list(monitor.active.values()):
            count[a.severity] = count.get(a.severity, 0) + 1
        for sev, n in count.items():
            firing.add_metric([sev], n)
        paused.add_metric([], 1.0 if reg.training_pause() is not None else 0.0)
        yield from (version, in_flight, pending, breakers, spent, caps, firing, paused)
