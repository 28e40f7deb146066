"""Trajectory records (flywheel.trajectories): what a rollout engine generated for one sample, with the
policy versions and engine attestation behind its tokens, and the verifier's :class:`Reward` for it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.schemas.base import Record
from shared.schemas.tasks import Task


class VersionSpan(BaseModel):
    """Completion tokens [start, end) were produced by policy ``version``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    version: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)

    def shifted(self, k: int) -> "VersionSpan":
        """The same span ``k`` tokens later (a segment appended after ``k`` earlier tokens)."""
        return VersionSpan(version=self.version, start=self.start + k, end=self.end + k)


class _CompletionTokens:
    """What :class:`Trajectory` and :class:`TrainSample` share beyond their fields (a plain mixin)."""

    @property
    def behaviour_version(self) -> int:
        """Oldest policy version that produced any completion token (0 when empty)."""
        return min((s.version for s in self.policy_versions), default=0)


def _check_aligned(rec):
    """``rec`` (a Trajectory or TrainSample) when its completion ids, log-probs and loss mask have one length.

    Raises:
        ValueError: the lengths differ.
    """
    n = len(rec.completion_ids)
    if len(rec.completion_logprobs) != n or len(rec.loss_mask) != n:
        raise ValueError(f"completion_ids ({n}), completion_logprobs ({len(rec.completion_logprobs)}) and "
                         f"loss_mask ({len(rec.loss_mask)}) must have equal lengths")
    return rec


class CanaryScore(BaseModel):
    """An engine's log-probs of the canary sequence (``shared/canary.py``) under one policy version."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    version: int = Field(ge=0)
    logprobs: list[float] = Field(max_length=4096)
    """Natural log, temperature 1, one per canary completion token."""


class Attestation(BaseModel):
    """What an engine says of the policy it generated with: who it is, its numeric kind, and its canary scores
    for the versions of the completion's spans. The trainer checks the scores against its own
    (``trainer_service/canary.py``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    engine: str = Field(min_length=1, max_length=256)
    """The rollout replica (``<host>:<pid>``)."""
    precision: str = Field(min_length=1, max_length=32)
    """``float32``, ``bfloat16`` or ``int8``: picks the tolerance (``shared.canary.TOLERANCE``)."""
    canary: list[CanaryScore] = Field(default_factory=list, max_length=64)


class Trajectory(_CompletionTokens, Record):
    """flywheel.trajectories, key group_id. Producer: rollout. Consumer: verifier.

    ``completion_logprobs[i]`` is the behaviour policy's log-probability (natural log, float) of
    ``completion_ids[i]`` under the sampling distribution (logits divided by ``temperature``);
    ``loss_mask[i]`` is 0 on tool output. The trainer scores the policy at the same temperature,
    so the importance ratio compares like with like.
    """

    SCHEMA: ClassVar[str] = "flywheel.Trajectory"
    VERSION: ClassVar[int] = 3
    READS: ClassVar[tuple[int, ...]] = (2,)
    trajectory_id: str
    group_id: str
    sample_index: int = Field(ge=0)
    group_size: int = Field(ge=1)
    task: Task
    purpose: Literal["train", "eval"] = "train"
    attempt: int = 1
    eval_round: int | None = None
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    loss_mask: list[int]
    completion_text: str
    finish_reason: Literal["stop", "length", "abort", "error"]
    error: str | None = None
    policy_versions: list[VersionSpan]
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature the completion was drawn at (0 = greedy, never trained)."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds: ``queue`` (request issued → picked up), ``generate`` (batch generation)."""
    turns: list[dict[str, Any]] = Field(default_factory=list)
    """Multi-turn (tool) trajectories: one record per turn, ``{role: assistant|tool, start, end, text}``
    (token offsets into the completion) plus ``tool_calls`` and ``seconds`` on tool turns."""
    cost: dict[str, float] = Field(default_factory=dict)
    """Rollout cost: ``generated_tokens``, ``tool_rounds``, ``tool_seconds``."""
    state: dict[str, Any] | None = None
    """A user environment's per-rollout state at the end of the rollout (``shared.envs``), which its rewards
    read; JSON, at most 64 KiB (``None``: not an environment rollout)."""
    attestation: Attestation | None = None
    """The engine's canary scores for the versions of ``policy_versions`` (``None``: an engine without
    them, e.g. SGLang or null)."""

    @model_validator(mode="after")
    def _aligned(self) -> "Trajectory":
        return _check_aligned(self)


class Reward(BaseModel):
    """Verifier output for one trajectory."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    total: float
    components: dict[str, float] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
    infra_error: bool = False
    """True when the reward could not be computed because of infrastructure (never a 0 reward)."""

    @property
    def passed(self) -> bool:
        """A pass: total reward of at least 1.0 and no infrastructure error (``RewardEvent.passed``,
        the pass rates, and the trainer's test for unsolved groups)."""
        return self.total >= 1.0 and not self.infra_error
