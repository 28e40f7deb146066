"""Scored records: the lean scored sample the trainer trains on (flywheel.scored) and the per-sample reward
summary for the scheduler and analysts (flywheel.rewards).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.schemas.base import Record
from shared.schemas.trajectories import (
    Attestation,
    Reward,
    Trajectory,
    VersionSpan,
    _check_aligned,
    _CompletionTokens,
)

TRAIN_SAMPLE_FIELDS = ("trajectory_id", "group_id", "sample_index", "group_size", "purpose", "attempt",
                       "prompt_ids", "completion_ids", "completion_logprobs", "loss_mask", "finish_reason",
                       "policy_versions", "temperature", "attestation")
"""The :class:`Trajectory` fields a :class:`TrainSample` copies as they are (it adds ``task_id`` and ``domain``
from the task)."""


class TrainSample(_CompletionTokens, BaseModel):
    """The part of a :class:`Trajectory` the trainer reads (flywheel.scored version 3): its ids, the token ids,
    behaviour log-probs, loss mask, policy-version spans and temperature it trains on, and the few identifiers
    its group buffer, traces and per-domain metrics use. No task, text, turns, timings or cost: those stay on
    flywheel.trajectories (the full Trajectory) and flywheel.rewards (:class:`RewardEvent`) for analysts.

    Field meanings are :class:`Trajectory`'s (``completion_logprobs``: natural log, behaviour policy at
    ``temperature``; ``loss_mask`` 0 on tool output)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    trajectory_id: str
    group_id: str
    sample_index: int = Field(ge=0)
    group_size: int = Field(ge=1)
    task_id: str = Field(min_length=1, max_length=512)
    domain: str = Field(min_length=1, max_length=256)
    purpose: Literal["train", "eval"] = "train"
    attempt: int = 1
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    loss_mask: list[int]
    finish_reason: Literal["stop", "length", "abort", "error"]
    policy_versions: list[VersionSpan]
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature the completion was drawn at (0 = greedy, never trained)."""
    attestation: Attestation | None = None
    """:attr:`Trajectory.attestation`: the trainer checks it before training the group."""

    @model_validator(mode="after")
    def _aligned(self) -> "TrainSample":
        return _check_aligned(self)

    @classmethod
    def of(cls, traj: Trajectory) -> "TrainSample":
        """The lean copy of ``traj`` (already validated, so built without validating again; the lists are
        shared, not copied)."""
        return cls.model_construct(task_id=traj.task.task_id, domain=traj.task.domain,
                                   **{k: getattr(traj, k) for k in TRAIN_SAMPLE_FIELDS})


class ScoredReward(BaseModel):
    """The part of a :class:`Reward` the trainer reads: the total and the infra_error flag (components and
    details go to flywheel.rewards, :class:`RewardEvent`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    total: float
    infra_error: bool = False
    """True when the reward could not be computed because of infrastructure (never a 0 reward)."""

    @property
    def passed(self) -> bool:
        """:attr:`Reward.passed`: a total of at least 1.0 and no infrastructure error."""
        return self.total >= 1.0 and not self.infra_error


class ScoredTrajectory(Record):
    """flywheel.scored, key group_id. Producer: verifier. Consumer: trainer.

    Version 3: lean, what the trainer trains on (:class:`TrainSample`, :class:`ScoredReward`);
    version 2 carried the whole Trajectory (its task, unit-test source included) and Reward. The full
    trajectory stays on flywheel.trajectories and the reward's summary on flywheel.rewards. Tolerant
    decoding: a version-2 record (an older verifier's, during an upgrade) still decodes, to its lean part.
    Built from a full :class:`Trajectory` and :class:`Reward` (``ScoredTrajectory(trajectory=traj,
    reward=reward)``), it keeps only that part (without validating the trajectory again)."""

    SCHEMA: ClassVar[str] = "flywheel.ScoredTrajectory"
    VERSION: ClassVar[int] = 3
    trajectory: TrainSample
    reward: ScoredReward

    @model_validator(mode="before")
    @classmethod
    def _from_version_2(cls, data: Any) -> Any:
        """A version-2 record (the full trajectory and reward) as its version-3 fields; runs before the
        version check of :class:`Record`."""
        if not (isinstance(data, dict) and data.get("schema_version") == 2 and data.get("schema") == cls.SCHEMA):
            return data
        tr, rw = data.get("trajectory"), data.get("reward")
        if isinstance(tr, dict):
            task = tr.get("task") if isinstance(tr.get("task"), dict) else {}
            tr = {**{k: tr[k] for k in TRAIN_SAMPLE_FIELDS if k in tr}, "task_id": task.get("task_id"),
                  "domain": task.get("domain")}
        if isinstance(rw, dict):
            rw = {k: rw[k] for k in ("total", "infra_error") if k in rw}
        return {**data, "schema_version": cls.VERSION, "trajectory": tr, "reward": rw}

    @field_validator("trajectory", mode="before")
    @classmethod
    def _lean_trajectory(cls, v: Any) -> Any:
        return TrainSample.of(v) if isinstance(v, Trajectory) else v

    @field_validator("reward", mode="before")
    @classmethod
    def _lean_reward(cls, v: Any) -> Any:
        return ScoredReward.model_construct(total=v.total, infra_error=v.infra_error) if isinstance(v, Reward) else v

    @classmethod
    def of(cls, traj: Trajectory, reward: Reward) -> "ScoredTrajectory":
        """The record for ``traj`` scored ``reward``, built without validating either again."""
        return cls.model_construct(schema_=cls.SCHEMA, schema_version=cls.VERSION, trajectory=TrainSample.of(traj),
                                   reward=ScoredReward.model_construct(total=reward.total,
                                                                       infra_error=reward.infra_error))


class RewardEvent(Record):
    """flywheel.rewards, key task_id. Producer: verifier. Consumers: scheduler, analytics."""

    SCHEMA: ClassVar[str] = "flywheel.RewardEvent"
    task_id: str
    group_id: str
    trajectory_id: str
    sample_index: int
    group_size: int
    domain: str
    difficulty: float
    purpose: Literal["train", "eval"]
    attempt: int = 1
    eval_round: int | None = None
    reward: float
    passed: bool
    infra_error: bool = False
    misconfigured: bool = False
    """The verifier found the task's spec itself broken (e.g. the gold answer does not parse): the scheduler
    pauses the domain and raises an alert (DESIGN.md, "Verification layers")."""
    reason: str | None = None
    """Why an infra_error happened (the verifier's ``details.reason``), for the alert."""
    completion_tokens: int
    finish_reason: str
    policy_version: int
    cost: dict[str, float] = Field(default_factory=dict)
    """What the sample cost, for the per-domain budgets: the trajectory's ``cost`` (``generated_tokens``,
    ``tool_rounds``, ``tool_seconds``) plus the verifier's ``sandbox_seconds`` (unit tests),
    ``judge_calls`` and ``verify_seconds``. Missing keys count 0."""
    completion_hash: str | None = Field(None, max_length=64)
    """16 hex digits of a hash of the completion text with whitespace runs collapsed and case folded
    (the drift monitor's within-group diversity and scorer-consistency checks; ``None``: not known)."""
    surprisal: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Mean −log-prob of the completion's generated tokens under the behaviour policy (nats per token): a
    Monte Carlo estimate of the sampling policy's per-token entropy (``None``: no generated token)."""
    hacks: list[str] = Field(default_factory=list, max_length=32)
    """Reward-hacking detectors that fired on this sample (``verifier_service.hacks``)."""
    event_time: float | None = Field(None, ge=0, allow_inf_nan=False)
    """When the verifier finished scoring the sample (Unix seconds; ``None``: a record written before the
    field existed). Event time for analytics: a redelivered trajectory is scored again with a later one."""
    verifier_kind: str | None = Field(None, max_length=64)
    """The task's verifier spec ``kind`` (``regex``, ``math``, ``unit_tests``...; ``None``: not known)."""
    components: dict[str, float] = Field(default_factory=dict, max_length=64)
    """Every verification layer computed, each in [0, 1] (``Reward.components``: ``correctness``, the
    rules such as ``format`` or ``truncation``, ``judge``). Before gates and weights; with an
    infra_error only the layers that completed."""
    gates: list[str] = Field(default_factory=list, max_length=32)
    """The recipe's gates that fired (a gating component below 1, which set the reward to 0:
    ``Reward.details["gated_by"]``), in the recipe's order."""
    metrics: dict[str, float] = Field(default_factory=dict, max_length=64)
    """What a user environment's reward functions reported (the ``environment`` kind): each function's value
    by its name (``None`` values left out) and each named metric as ``<function>.<metric>``."""
