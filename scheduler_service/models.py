"""Request and response bodies of the REST API (Create/Public families).

:class:`TaskCreate` extends :class:`shared.schemas.TaskBody`, the fields and validators of the Task
record, so a task the API accepts is a valid Task record.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    """Body of ``POST /v1/tasks``."""

    model_config = ConfigDict(extra="forbid")
    tasks: list[TaskCreate] = Field(min_length=1, max_length=10000)


class TaskIds(BaseModel):
    """Answer of ``POST /v1/tasks``: the ids, in the order posted."""

    task_ids: list[str]


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


class EvalCreate(BaseModel):
    """Body of ``POST /v1/evals``."""

    model_config = ConfigDict(extra="forbid")
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
    paused_domains: dict[str, str] = Field(default_factory=dict)
    """Domains whose training groups are not issued, with the reason (resume: ``POST /v1/domains/{d}/resume``)."""
