"""The scheduler's Prometheus metrics, served on its API at ``GET /metrics`` (``routes/metrics.py``).

This module only defines the metric families; it imports no other scheduler module, so every module that
feeds it can import it. The counters and the staleness histogram are fed where the sampler and the drift
guard act (issuing, scoring, drops, dead letters, alerts: :mod:`scheduler_service.metrics_feed`,
``scheduler_service.guard``). The gauges (policy version, groups in flight, breaker states, budget spend,
alerts firing) are read from the registry and the monitor when scraped
(:class:`scheduler_service.metrics_feed.StateCollector`), so they cost nothing between scrapes and are never stale.

Domain labels go through a :class:`shared.metrics.DomainLabels` per process (the first 128 domains, then ``other``);
a gauge over several domains folded into ``other`` is their sum (spend) or their worst state (breakers).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from shared.metrics import MAX_DOMAINS, VERSIONS, ServiceMetrics


class SchedulerMetrics(ServiceMetrics):
    """The scheduler's metric families on one registry (one per
    :class:`scheduler_service.state.SchedulerState`)."""

    def __init__(self, registry: CollectorRegistry | None = None, max_domains: int = MAX_DOMAINS) -> None:
        super().__init__(registry, max_domains)
        r = self.registry
        dp = ["domain", "purpose"]
        self.groups_issued = Counter("flywheel_scheduler_groups_issued", "Groups sent as rollout requests for the "
                                     "first time (purpose train or eval).", dp, registry=r)
        self.groups_reissued = Counter("flywheel_scheduler_groups_reissued", "Groups sent again after their deadline "
                                       "passed.", dp, registry=r)
        self.groups_completed = Counter("flywheel_scheduler_groups_completed", "Groups whose every sample came back "
                                        "scored (or failed).", dp, registry=r)
        self.groups_abandoned = Counter("flywheel_scheduler_groups_abandoned", "Groups given up after "
                                        "scheduler.max_attempts deadlines.", registry=r)
        self.samples_scored = Counter("flywheel_scheduler_samples_scored", "Samples counted with a reward (not an "
                                      "infrastructure error).", dp, registry=r)
        self.samples_passed = Counter("flywheel_scheduler_samples_passed", "Scored samples that passed.", dp,
                                      registry=r)
        self.infra_errors = Counter("flywheel_scheduler_infra_errors", "Samples counted as infrastructure errors "
                                    "(sandbox or judge down, generation error).", ["domain"], registry=r)
        self.group_drops = Counter("flywheel_scheduler_group_drops", "GroupDropped records read from "
                                   "flywheel.group_drops, by the trainer's reason.", ["reason"], registry=r)
        self.dlq = Counter("flywheel_scheduler_dlq_records", "Records the scheduler could not decode, sent to "
                           "flywheel.dlq, by source topic.", ["topic"], registry=r)
        self.alerts = Counter("flywheel_scheduler_alerts", "Alert records raised by the drift monitor.",
                              ["severity", "signal", "status"], registry=r)
        self.staleness = Histogram("flywheel_scheduler_staleness_versions", "Policy version when a training "
                                   "sample was scored minus its behaviour version.", buckets=VERSIONS, registry=r)
