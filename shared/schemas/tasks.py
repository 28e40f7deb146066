"""Task records: the task itself (flywheel.tasks) and the request to generate its samples
(flywheel.rollout.requests), with the chat and sampling pieces they are made of.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.jsoncheck import check_json as _check_json
from shared.jsoncheck import check_size as _check_size
from shared.schemas.base import Record, require_utf8
from shared.topics import POOL_PATTERN
from shared.verifier_specs import VerifierSpec

MAX_MESSAGE_CHARS = 100_000
"""Longest chat message accepted (characters); longer prompts cannot fit a policy's context anyway."""
MAX_METADATA_BYTES = 1024 * 1024
"""Largest ``metadata`` of a task (bytes of compact JSON)."""


class ChatMessage(BaseModel):
    """One chat turn."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(min_length=1, max_length=MAX_MESSAGE_CHARS)


class SamplingParams(BaseModel):
    """Sampling parameters of one rollout request."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_new_tokens: int = Field(24, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None


class TaskBody(BaseModel):
    """The fields of a task, shared by the Task record and the scheduler's REST body (one validation)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    domain: str = Field(min_length=1, max_length=256)
    """Domain name (e.g. ``basic_arithmetic``, ``humaneval``)."""
    prompt: list[ChatMessage] = Field(min_length=1, max_length=256)
    """Chat messages; at least one that is not a system message."""
    verifier: VerifierSpec
    """How the completion is scored, tagged by ``kind``."""
    samples_per_task: int = Field(8, ge=2, le=1024)
    """K: samples per training group (evaluation always uses one greedy sample)."""
    difficulty: float = Field(0.0, ge=-1e9, le=1e9, allow_inf_nan=False)
    """Difficulty estimate (domain-specific scale, within ±1e9)."""
    split: Literal["train", "eval"] = "train"
    """``train`` tasks are sampled for training; ``eval`` tasks form the held-out evaluation."""
    max_turns: int = Field(1, ge=1, le=100)
    """Turns of the tool loop."""
    tools: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(default_factory=list, max_length=64)
    """Tool names the model may call."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form metadata carried with the task (at most 32 levels deep and 1 MiB as JSON)."""
    pool: str | None = Field(None, pattern=POOL_PATTERN)
    """Rollout pool whose replicas generate this task (``None``: its domain's pool, see
    ``shared.topics.rollout_requests``)."""

    @field_validator("metadata")
    @classmethod
    def _storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_size(_check_json(v), MAX_METADATA_BYTES, "metadata")

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        return require_utf8(data)

    @field_validator("prompt")
    @classmethod
    def _has_non_system_turn(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if all(m.role == "system" for m in v):
            raise ValueError("needs at least one message that is not a system message")
        return v


def check_task_id(v: str) -> str:
    """``v`` unchanged when it can be addressed as ``GET /v1/tasks/<id>``.

    Raises:
        ValueError: it is ``.`` or ``..`` (clients collapse those URL segments).
    """
    if v in (".", ".."):
        raise ValueError("a task id cannot be '.' or '..' (URLs collapse those segments)")
    return v


class Task(Record, TaskBody):
    """flywheel.tasks, key task_id. Producer: scheduler (on registration). Consumers: analytics.

    Version 2: every field of the task and its verifier spec is bounded (sizes, numbers), and
    ``kind`` is required in the spec's schema; RolloutRequest, Trajectory and ScoredTrajectory, which carry
    a Task, are version 2 with it.

    Version 3: the ``environment`` verifier kind (a user environment's rubric); RolloutRequest and Trajectory
    are version 3 with it. Version-2 records are valid version-3 records and still decode."""

    SCHEMA: ClassVar[str] = "flywheel.Task"
    VERSION: ClassVar[int] = 3
    READS: ClassVar[tuple[int, ...]] = (2,)
    task_id: str = Field(min_length=1, max_length=512)

    @field_validator("task_id")
    @classmethod
    def _url_safe(cls, v: str) -> str:
        return check_task_id(v)


class RolloutRequest(Record):
    """flywheel.rollout.requests, key group_id. Producer: scheduler. Consumer: rollout."""

    SCHEMA: ClassVar[str] = "flywheel.RolloutRequest"
    VERSION: ClassVar[int] = 3
    READS: ClassVar[tuple[int, ...]] = (2,)
    group_id: str
    task: Task
    n: int = Field(ge=1, le=1024)
    sampling: SamplingParams
    purpose: Literal["train", "eval"] = "train"
    attempt: int = Field(1, ge=1)
    min_policy_version: int = Field(0, ge=0)
    eval_round: int | None = None
    issued_at: float = Field(default_factory=time.time)
