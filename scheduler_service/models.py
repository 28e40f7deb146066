"""Request and response bodies of the REST API (Create/Public families).

:class:`TaskCreate` extends :class:`shared.schemas.TaskBody`, the fields and validators of the Task
record, so a task the API accepts is a valid Task record.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scheduler_service.config import DomainConfig
from shared.schemas import Task, TaskBody, check_task_id


class TaskCreate(TaskBody):
    """One task to register: the Task record's fields (same validation), ``task_id`` optional."""

    task_id: str | None = Field(None, min_length=1, max_length=512)
    """Stable id; a uuid4 hex is assigned when missing. Re-posting the same id and content is idempotent."""

    @field_validator("task_id")
    @classmethod
    def _addressable(cls, v: str | None) -> str | None:
        return v if v is None else check_task_id(v)

    def to_task(self) -> Task:
        """The Task record (with a fresh uuid4 hex id when none was given)."""
        data = self.model_dump()
        data["task_id"] = self.task_id or uuid.uuid4().hex
        return Task(**data)


class TaskBatchCreate(BaseModel):
    """Body of ``POST /v1/tasks`` (validated strictly, task by task: ``"1"`` is no number, ``true`` none
    either; ``scheduler_service.routes.tasks.validate_batch``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tasks: list[TaskCreate] = Field(min_length=1, max_length=10000)


class Duplicate(BaseModel):
    """A posted task whose content (domain, normalised prompt, verifier spec) is already stored."""

    task_id: str
    duplicate_of: str


class TaskIds(BaseModel):
    """Answer of ``POST /v1/tasks``: the ids, in the order posted; ``duplicates``: the posted tasks not
    stored because a task of the same domain with the same content is (their ids resolve to it; the
    field is left out when there is none)."""

    task_ids: list[str]
    duplicates: list[Duplicate] = Field(default_factory=list)


class TaskPublic(BaseModel):
    """Answer of ``GET /v1/tasks/{task_id}``."""

    task_id: str
    domain: str
    split: Literal["train", "eval"]
    state: str
    samples: int
    passes: int
    pass_rate: float | None
    groups_issued: int
    """``registered``, ``active`` (issued at least once) or ``retired`` (solved in every sample of its last
    ``lifecycle.retire_after`` groups: no longer trained, kept for evaluation and statistics)."""
    level: int | None = None
    """Its domain level, shown when not 0."""
    flagged: bool | None = None
    """Shown (True) when no sample passed in ``lifecycle.flag_after`` groups."""
    duplicate_of: str | None = None
    """Shown when the id asked for was posted as a duplicate of this task."""


class EvalCreate(BaseModel):
    """Body of ``POST /v1/evals``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    min_policy_version: int | None = Field(None, ge=0, le=2**53)
    """Policy version the items must be generated with at least (``None`` = the current one)."""


class EvalRoundId(BaseModel):
    """Answer of ``POST /v1/evals``."""

    eval_round: int


class EvalRoundPublic(BaseModel):
    """One eval round: accuracy = correct / completed (``None`` before any completion)."""

    eval_round: int
    min_policy_version: int
    n: int
    completed: int
    correct: int
    accuracy: float | None
    abandoned: int
    policy_versions: list[int]
    done: bool
    created_at: float


class MetricsRecord(BaseModel):
    """One trainer Metrics record of ``GET /v1/metrics/history``."""

    step: int
    policy_version: int | None
    values: dict[str, float]
    time: float


class Staleness(BaseModel):
    """Policy version minus behaviour version over recent train reward events."""

    mean: float | None
    max: float | None


class StatusPublic(BaseModel):
    """Answer of ``GET /v1/status``."""

    policy_version: int
    in_flight_groups: int
    pending_groups: int
    issued_groups: int
    completed_groups: int
    abandoned_groups: int
    dropped_groups: dict[str, int] = Field(default_factory=dict)
    """Training groups the trainer reported dropped (flywheel.group_drops), per reason; each gave its
    slot in the issue budget back."""
    samples_scored: int
    throughput_samples_per_s: float
    staleness: Staleness
    train_reward_mean: float | None
    tasks: dict[str, int]
    trainer: dict[str, float]
    trainer_step: int | None
    evals: list[EvalRoundPublic]
    cost: dict[str, dict[str, float]] = Field(default_factory=dict)
    """What the run's samples cost so far, per purpose (``train``, ``eval``): samples, generated_tokens,
    tool_rounds, tool_seconds, sandbox_seconds, judge_calls, verify_seconds (per domain: ``GET /v1/domains``)."""
    domains: dict[str, int] = Field(default_factory=dict)
    """Domains per status (see ``GET /v1/domains``)."""
    paused_domains: dict[str, str] = Field(default_factory=dict)
    """Domains whose training groups are not issued, with the reason (resume: ``POST /v1/domains/{d}/resume``)."""
    alerts: dict[str, Any] = Field(default_factory=dict)
    """Drift alerts firing now: ``active`` (count), ``critical``, ``warning``, ``info`` (counts) and ``firing``
    (their keys, ``<domain>/<signal>``); the records: ``GET /v1/alerts``."""
    breakers: dict[str, str] = Field(default_factory=dict)
    """Domains whose circuit breaker is not closed, with its state (``open``, ``half_open``)."""
    training_paused: dict[str, Any] | None = None
    """Set while training is paused run-wide: ``reason``, ``since``, ``by``."""
    stalled: dict[str, Any] | None = None
    """Set while the run cannot go on (``scheduler.stall_after_s``): ``since`` (Unix seconds), ``domains`` (each
    domain's reason: retired, paused, over budget, every training task retired, a generator that ran dry) and
    ``message``; the ``run/stalled`` alert says the same."""


class ControlBody(BaseModel):
    """``POST /v1/control``: one operator command, the fields of a ``flywheel.control`` record
    (``shared.schemas.Control``; ``domain_state`` is the scheduler's own and is refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    command: Literal["pause_domain", "resume_domain", "open_breaker", "close_breaker", "set_threshold",
                     "pause_training", "resume_training"]
    domain: str | None = Field(None, min_length=1, max_length=256)
    signal: str | None = Field(None, min_length=1, max_length=64)
    threshold: dict[Annotated[str, Field(max_length=32)],
                    Annotated[float, Field(ge=-1e15, le=1e15, allow_inf_nan=False)] | bool | None] | None = Field(
        None, max_length=8)
    """``set_threshold``: any of ``warning``, ``critical``, ``min_rise``, ``min_samples``, ``enabled`` (finite)."""
    reason: str = Field("", max_length=1000)


class AlertsPublic(BaseModel):
    """``GET /v1/alerts``: the alerts firing now and the newest records (firing and resolved), newest first."""

    active: list[dict[str, Any]]
    recent: list[dict[str, Any]]


class DomainPublic(BaseModel):
    """One domain in ``GET /v1/domains``: its config and what the scheduler knows of it.

    ``status``: ``active`` (issued), ``paused`` (by the verifier, ``pause_reason``, or by config),
    ``retired``, ``over_budget`` (a cap in ``config.budget`` reached; ``over_budget`` says which),
    ``no_tasks`` (no live training task at its level; a generator domain makes more), ``zero_weight``.
    ``share``: its fraction of the training groups the mix issued so far (re-samples not counted).
    ``seconds_per_group``: wall seconds from issue to the last reward per completed training group;
    ``work_seconds_per_group``: tool, sandbox and verifier seconds plus 1 ms per generated token, per group
    (what ``scheduler.issue_order: cost`` compares).
    ``spend``: per purpose (``train``, ``eval``): samples, generated_tokens, tool_rounds, tool_seconds,
    sandbox_seconds, judge_calls, verify_seconds, groups (complete), group_seconds (wall, issue → last
    reward). ``budget_left``: cap − training spend per capped key.
    """

    domain: str
    config: DomainConfig
    status: str
    pause_reason: str | None = None
    over_budget: str | None = None
    level: int
    level_name: str
    levels: int
    recent_pass_rate: float | None
    level_samples: int
    tasks: dict[str, int]
    live_by_level: dict[int, int]
    groups_issued: int
    share: float | None
    seconds_per_group: float | None
    work_seconds_per_group: float | None = None
    spend: dict[str, dict[str, float]]
    budget_left: dict[str, float]
    generator_error: str | None = None
    breaker: dict[str, Any] = Field(default_factory=dict)
    """The domain's circuit breaker: ``state`` (closed, open, half_open), ``since``, ``signal`` (what opened
    it), ``trips``, ``manual``, ``cooldown_s``, ``probe_groups``, ``probe_deadline``."""
    alerts: list[str] = Field(default_factory=list)
    """Signals of the domain's alerts firing now (``<signal>:<severity>``)."""


class DomainDetail(DomainPublic):
    """``GET /v1/domains/{domain}``: a domain with its latest events (level moves, generated batches,
    pauses) and the ids of its retired, flagged and duplicate tasks (up to 100 each)."""

    events: list[dict[str, Any]]
    retired_tasks: list[str]
    flagged_tasks: list[str]
    duplicate_tasks: list[str]
