"""The verifier's Prometheus metrics, served on ``telemetry.metrics_host:metrics_port``.

Fed once per trajectory in :func:`verifier_service.main._handle` (:meth:`VerifierMetrics.scored`), from
what scoring already measured (``RewardEvent.cost``): no extra clock and no per-token work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

from shared.metrics import MAX_DOMAINS, SECONDS_FAST, ServiceMetrics

if TYPE_CHECKING:
    from shared.schemas import Reward, Trajectory


class VerifierMetrics(ServiceMetrics):
    """The verifier's families on one registry (one per service run)."""

    def __init__(self, registry: CollectorRegistry | None = None, max_domains: int = MAX_DOMAINS) -> None:
        super().__init__(registry, max_domains)
        r = self.registry
        self.verify_seconds = Histogram(
            "flywheel_verifier_verify_seconds", "Seconds in the scorer for one trajectory, every attempt, retry "
            "back-off not counted, by verifier kind.", ["kind"], buckets=SECONDS_FAST, registry=r)
        self.rewards = Counter("flywheel_verifier_rewards", "Trajectories scored (infrastructure errors not "
                               "counted), by domain, verifier kind and whether they passed.",
                               ["domain", "kind", "passed"], registry=r)
        self.infra_errors = Counter("flywheel_verifier_infra_errors", "Trajectories that could not be scored "
                                    "(sandbox or judge down, generation error), by verifier kind.", ["kind"],
                                    registry=r)
        self.hacks = Counter("flywheel_verifier_hacks", "Reward-hacking detector hits (verifier_service/hacks/), "
                             "by detector.", ["detector"], registry=r)
        self.gates = Counter("flywheel_verifier_gates", "Rewards zeroed by a recipe gate (a gate component "
                             "below 1), by gate.", ["gate"], registry=r)
        self.sandbox_seconds = Histogram(
            "flywheel_verifier_sandbox_seconds", "Wall seconds of the sandbox requests of one trajectory's unit "
            "tests (every attempt).", buckets=SECONDS_FAST, registry=r)
        self.dlq = Counter("flywheel_verifier_dlq_records", "Records sent to flywheel.dlq, by source topic.",
                           ["topic"], registry=r)

    def scored(self, traj: "Trajectory", reward: "Reward", cost: dict[str, float]) -> None:
        """Count one trajectory's verification; ``cost`` as :func:`verifier_service.main.score_with_retries`
        filled it (``verify_seconds`` absent: the scorer never ran, e.g. an aborted generation)."""
        kind = traj.task.verifier.kind
        if "verify_seconds" in cost:
            self.verify_seconds.labels(kind).observe(cost["verify_seconds"])
        if "sandbox_seconds" in cost:
            self.sandbox_seconds.observe(cost["sandbox_seconds"])
        if reward.infra_error:
            self.infra_errors.labels(kind).inc()
        else:
            self.rewards.labels(self.domain(traj.task.domain), kind, "true" if reward.passed else "false").inc()
        for name in reward.details.get("hacks", {}):
            self.hacks.labels(str(name)).inc()
        for name in reward.details.get("gated_by", []):
            self.gates.labels(str(name)).inc()
