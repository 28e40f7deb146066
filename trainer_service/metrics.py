"""The trainer's Prometheus metrics, served on ``telemetry.metrics_host:metrics_port``.

Fed once per step from what the step already measured (its ``time/*`` seconds, its groups), once per
dropped group and per dead letter: nothing per token, nothing inside the optimizer step. The policy
version gauge reads the trainer when scraped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.metrics import MAX_DOMAINS, SECONDS_SLOW, VERSIONS, ServiceMetrics

if TYPE_CHECKING:
    from trainer_service.groups import Drop, Group

PHASES = {"time/wait_for_data_s": "wait_for_data", "time/train_step_s": "train_step", "time/snapshot_s": "snapshot",
          "time/update_gate_s": "update_gate", "time/publish_s": "publish", "time/broadcast_s": "broadcast",
          "time/checkpoint_s": "checkpoint"}
"""The step's timings (``trainer_service.main``) → the ``phase`` label of ``flywheel_trainer_phase_seconds``:
waiting for ``batch_groups`` ready groups since the previous step, the optimizer step (plan, forward and
backward, AdamW), handing the weights and optimizer state to the publisher (a CPU copy only for a CUDA model;
~0 s otherwise), the part of the optimizer step spent waiting for the previous version's files
(``PolicyTrainer.update_gate``), step end → version announced (weights written), the torch.distributed
broadcast (``weights.transport: distributed``), step end → trainer state written."""


class TrainerMetrics(ServiceMetrics):
    """The trainer's families on one registry (one per service run)."""

    def __init__(self, registry: CollectorRegistry | None = None, max_domains: int = MAX_DOMAINS) -> None:
        super().__init__(registry, max_domains)
        r = self.registry
        self.phase_seconds = Histogram("flywheel_trainer_phase_seconds", "Seconds of each phase of a step "
                                       "(trainer_service.metrics.PHASES).", ["phase"], buckets=SECONDS_SLOW,
                                       registry=r)
        self.steps = Counter("flywheel_trainer_steps", "Optimizer steps published (each one policy version).",
                             registry=r)
        self.policy_version = Gauge("flywheel_trainer_policy_version", "Policy version of the trainer's model.",
                                    registry=r)
        self.staleness = Histogram("flywheel_trainer_staleness_versions", "Per trained sample: the version the "
                                   "step trained from minus the sample's behaviour version.", buckets=VERSIONS,
                                   registry=r)
        self.groups_dropped = Counter("flywheel_trainer_groups_dropped", "Groups announced on flywheel.group_drops, "
                                      "by reason (stale, failed, superseded_unsolved, unsolved, canary, circuit_open, domain_paused).",
                                      ["reason"], registry=r)
        self.samples_trained = Counter("flywheel_trainer_samples_trained", "Samples of the groups a published step "
                                       "trained, by domain.", ["domain"], registry=r)
        self.groups_trained = Counter("flywheel_trainer_groups_trained", "Groups a published step trained, by "
                                      "domain.", ["domain"], registry=r)
        self.weight_publish_seconds = Histogram(
            "flywheel_trainer_weight_publish_seconds", "Seconds from a step's end to its version announced on "
            "flywheel.weights (weights written, broadcast prepared), the snapshot not counted.",
            buckets=SECONDS_SLOW, registry=r)
        self.dlq = Counter("flywheel_trainer_dlq_records", "Records sent to flywheel.dlq, by source topic.",
                           ["topic"], registry=r)
        self.disk_free_bytes = Gauge("flywheel_trainer_disk_free_bytes", "Free bytes on the checkpoint store's "
                                     "file system at the last check (before each checkpoint write).", registry=r)
        self.checkpoint_bytes = Gauge("flywheel_trainer_checkpoint_bytes", "Expected bytes of the checkpoint "
                                      "being written (weights plus trainer state).", registry=r)
        self.disk_level = Gauge("flywheel_trainer_disk_level", "Free-space level of the checkpoint store: 0 ok, "
                                "1 warning, 2 critical (no checkpoint written, no step taken until space is "
                                "freed).", registry=r)
        self.checkpoint_waits = Counter("flywheel_trainer_checkpoint_waits", "Checkpoint writes deferred for lack "
                                        "of disk space (each retried after trainer.disk_retry_s).", registry=r)

    def disk(self, free: int, need: int, level: str) -> None:
        """Record a free-space check: ``free`` bytes available, ``need`` bytes to write, its ``level``."""
        self.disk_free_bytes.set(free)
        self.checkpoint_bytes.set(need)
        self.disk_level.set({"ok": 0, "warning": 1, "critical": 2}[level])

    def watch_version(self, version: Callable[[], int]) -> None:
        """Read the policy version gauge from ``version()`` at scrape time."""
        self.policy_version.set_function(lambda: float(version()))

    def published(self, groups: Iterable["Group"], version: int, timings: dict[str, float]) -> None:
        """Count one published step: it trained ``groups`` and produced policy ``version``; ``timings`` is
        its metrics (the ``time/*`` seconds of :data:`PHASES` that it has are observed)."""
        self.steps.inc()
        for key, phase in PHASES.items():
            if key in timings:
                self.phase_seconds.labels(phase).observe(timings[key])
        if "time/publish_s" in timings:
            self.weight_publish_seconds.observe(timings["time/publish_s"])
        for g in groups:
            d = self.domain(g.domain if g.samples else None)
            self.groups_trained.labels(d).inc()
            self.samples_trained.labels(d).inc(len(g.samples))
            for s in g.samples.values():
                self.staleness.observe(max(0, version - 1 - s.trajectory.behaviour_version))

    def dropped(self, drops: Iterable["Drop"]) -> None:
        """Count groups whose drop was announced."""
        for d in drops:
            self.groups_dropped.labels(d.reason).inc()
