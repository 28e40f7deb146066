"""Operational records: metrics (flywheel.metrics), dropped groups (flywheel.group_drops), alerts
(flywheel.alerts), operator control (flywheel.control) and dead letters (flywheel.dlq).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from shared.schemas.base import Record


class Metrics(Record):
    """flywheel.metrics, key source. Producer: any service. Consumers: analytics, scheduler.

    ``values`` uses names prefixed by area (``loss/``, ``rollout/``, ``train/``...). The families:

    - ``source: trainer``, ``step`` set: per optimizer step, one run-wide record (``domain`` None: ``loss/*``,
      ``train/*``, ``time/*``) and one per domain trained in the step (``train/reward_mean``,
      ``train/pass_rate``, ``train/samples``, ``train/completion_tokens_mean``, ``train/truncated_frac``...).
    - ``source: scheduler`` with ``eval/*`` values: per finished eval round, one run-wide record and one per
      domain (``eval/accuracy``, ``eval/correct``, ``eval/n``, ``eval/round``...); ``policy_version`` is the
      newest version that answered in the round.
    - ``source: scheduler`` with ``scheduler/*`` values: periodic gauges and counters of the sampler.
    - ``source: rollout`` / ``verifier``: periodic counters of those services.
    """

    SCHEMA: ClassVar[str] = "flywheel.Metrics"
    source: str
    step: int | None = None
    policy_version: int | None = None
    domain: str | None = Field(None, min_length=1, max_length=256)
    """The domain the values are about (``None``: run-wide). The trainer sends one run-wide record per step
    and one per domain trained in it; the scheduler one run-wide and one per domain per finished eval round."""
    values: dict[str, float]
    """Finite values only: a NaN or infinite value is left out when the record is built (JSON has no NaN;
    orjson would write ``null`` and the whole record would then fail to decode and go to the DLQ)."""
    time: float = Field(default_factory=time.time)

    @field_validator("values", mode="after")
    @classmethod
    def _finite_only(cls, v: dict[str, float]) -> dict[str, float]:
        return v if all(math.isfinite(x) for x in v.values()) else {k: x for k, x in v.items() if math.isfinite(x)}


DropReason = Literal["stale", "failed", "superseded_unsolved", "unsolved", "canary", "domain_paused",
                     "circuit_open"]
"""Why the trainer did not train a complete (or failed) group: see :class:`GroupDropped`."""


class GroupDropped(Record):
    """flywheel.group_drops, key group_id. Producer: trainer. Consumers: scheduler, analytics.

    One record per training group the trainer will never train, sent (and acknowledged) before the
    trainer commits the group's offsets on flywheel.scored, so no drop is lost to a crash; a
    redelivery may send it twice (consumers are idempotent by ``group_id``). The scheduler gives the
    group's slot in its issue budget back, so the run still reaches ``max_steps``:

    - ``stale``: its oldest token is more than η versions behind the trainer (``behaviour_version``).
    - ``failed``: a sample was an infrastructure error or its generation failed or was aborted.
    - ``superseded_unsolved``: an unsolved group set aside for its larger re-sample
      (``scheduler.resample_unsolved``); the slot comes back only if no re-sample was written.
    - ``unsolved``: with re-sampling on, an unsolved group that gets no re-sample (a re-sample itself, or a
      group as large): every advantage is 0, so it would train only the KL term at the cost of a full pass.
    - ``canary``: a sample's engine scored the canary sequence too far from the trainer's weights of that
      version (``trainer_service/canary.py``): it did not serve the published policy.
    - ``domain_paused``, ``circuit_open``: the domain stopped training while the group was in flight.
    """

    SCHEMA: ClassVar[str] = "flywheel.GroupDropped"
    VERSION: ClassVar[int] = 2
    group_id: str
    reason: DropReason
    policy_version: int = Field(ge=0)
    """The trainer's policy version when it dropped the group."""
    behaviour_version: int | None = Field(None, ge=0)
    """Oldest policy version that produced a token of the group (``None`` when no sample had one)."""
    samples: int = Field(0, ge=0)
    """Samples of the group the trainer had received."""
    time: float = Field(default_factory=time.time)


Severity = Literal["info", "warning", "critical"]
"""How bad an :class:`Alert` is: ``critical`` opens the domain's circuit breaker (run-wide: it pauses
training), ``warning`` is reported only, ``info`` marks breaker transitions and operator actions."""


class Alert(Record):
    """flywheel.alerts, key :attr:`key` (``<domain>/<signal>``, ``run/<signal>`` for run-wide signals).
    Producer: the scheduler's drift monitor (``scheduler_service.monitor``). Consumers: analytics, CLI.

    One record when a condition starts (``status: firing``) or changes severity, one when it ends
    (``resolved``); nothing while it holds (deduplicated by :attr:`key`). Breaker transitions are alerts
    of signal ``breaker`` (``open`` is critical; ``half_open``/``closed`` are info).
    """

    SCHEMA: ClassVar[str] = "flywheel.Alert"
    source: str = "scheduler"
    domain: str | None = None
    """The domain the signal is about (``None``: run-wide, e.g. the trainer's KL)."""
    signal: str = Field(min_length=1, max_length=64)
    """Signal name (docs/guides/drift.md): ``pass_rate_jump``, ``truncation_rate``, ``breaker``..."""
    status: Literal["firing", "resolved"] = "firing"
    severity: Severity = "warning"
    value: float | None = None
    """The signal's value over the window (units per signal; docs/guides/drift.md)."""
    threshold: float | None = None
    """The threshold the value crossed (for ``resolved``: the one it had crossed)."""
    reference: float | None = None
    """The same statistic over the reference window, when the signal compares two windows."""
    window: int = Field(0, ge=0)
    """Size of the window the value was computed over, in :attr:`window_unit`."""
    window_unit: Literal["samples", "groups", "rounds", "steps"] = "samples"
    policy_version: int = Field(0, ge=0)
    """The scheduler's policy version when the alert was raised."""
    message: str = Field(max_length=4096)
    """One human sentence: what was seen, against what, and what happens now."""
    details: dict[str, Any] = Field(default_factory=dict)
    time: float = Field(default_factory=time.time)

    @property
    def key(self) -> str:
        """Deduplication key and Kafka key: ``<domain>/<signal>`` or ``run/<signal>``."""
        return f"{self.domain if self.domain is not None else 'run'}/{self.signal}"


ControlCommand = Literal["pause_domain", "resume_domain", "open_breaker", "close_breaker", "set_threshold",
                         "pause_training", "resume_training", "domain_state"]
"""Operator commands, plus ``domain_state``: the scheduler's announcement of whether a domain trains."""
_DOMAIN_COMMANDS = {"pause_domain", "resume_domain", "open_breaker", "close_breaker", "domain_state"}


class Control(Record):
    """flywheel.control, key the domain (``run`` for run-wide commands).

    Producers: operators (CLI, or any Kafka client), the scheduler (its REST control routes publish the
    command here and apply it when they read it back; it announces every change of a domain's
    trainability as ``domain_state``). Consumers: the scheduler (group ``<scheduler.consumer_group>-control``:
    applies commands, durably, then commits), the trainer (folds ``domain_state`` and
    ``pause_training``/``resume_training`` from the earliest offset: which domains' groups it drops, and
    whether it steps).

    - ``pause_domain``/``resume_domain``: stop/restart issuing the domain's training groups (the trainer
      drops its groups in flight, ``domain_paused``).
    - ``open_breaker``: force the domain's breaker open (no automatic probe until ``close_breaker``).
    - ``close_breaker``: close it now (the monitor's windows restart from the pre-trip reference).
    - ``set_threshold``: override ``signal``'s thresholds (``threshold``: any of ``warning``, ``critical``,
      ``min_rise``, ``min_samples``, ``enabled``) run-wide, or for ``domain`` when given.
    - ``pause_training``/``resume_training``: run-wide: no training groups are issued and the trainer
      takes no step (its last checkpoint stays the newest); evaluation goes on.
    - ``domain_state`` (scheduler only): ``trainable`` false with ``reason`` ``circuit_open`` or
      ``domain_paused``, or true.
    """

    SCHEMA: ClassVar[str] = "flywheel.Control"
    command: ControlCommand
    domain: str | None = Field(None, min_length=1, max_length=256)
    signal: str | None = Field(None, min_length=1, max_length=64)
    threshold: dict[str, float | bool | None] | None = None
    trainable: bool | None = None
    drop_groups: list[str] = Field(default_factory=list, max_length=1024)
    """``domain_state``: training groups the trainer must drop whatever the domain's state (``circuit_open``):
    the probe of a breaker that closes, whose last samples may reach the trainer after the domain trains
    again."""
    reason: str = Field("", max_length=1000)
    origin: str = Field("operator", min_length=1, max_length=64)
    """Who sent it (``operator``, ``cli``, ``rest``, ``scheduler``)."""
    control_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=64)
    time: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _fields(self) -> "Control":
        if self.command in _DOMAIN_COMMANDS and self.domain is None:
            raise ValueError(f"domain: required by command {self.command!r}")
        if self.command == "set_threshold" and (self.signal is None or not self.threshold):
            raise ValueError("signal and threshold: required by command 'set_threshold'")
        if self.command == "domain_state" and self.trainable is None:
            raise ValueError("trainable: required by command 'domain_state'")
        return self

    @property
    def key(self) -> str:
        """Kafka key: the domain, or ``run``."""
        return self.domain or "run"


class DeadLetter(Record):
    """flywheel.dlq, key = the original key. Producer: any consumer that met a malformed record."""

    SCHEMA: ClassVar[str] = "flywheel.DeadLetter"
    source_topic: str
    partition: int
    offset: int
    consumer: str
    reason: str
    payload: str
    """The original value, decoded as UTF-8 with replacement (truncated to 64 KiB)."""
    time: float = Field(default_factory=time.time)
