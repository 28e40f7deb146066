"""Message schemas: one record type per topic (DESIGN.md, "Topics and messages").

Every record is one JSON object encoded with orjson, carrying ``schema`` (its name) and
``schema_version``. :func:`decode` validates; a record that fails goes to flywheel.dlq as a
:class:`DeadLetter` with the reason (see ``shared.kafka``).

This package is the record contract: import every name from ``shared.schemas``. The modules hold one
family of topics each:

- :mod:`shared.schemas.base`: :class:`Record`, :func:`decode`, :class:`DecodeError`, :func:`require_utf8`;
- :mod:`shared.schemas.tasks`: flywheel.tasks and flywheel.rollout.requests (:class:`Task`,
  :class:`RolloutRequest`, :class:`TaskBody`, :class:`ChatMessage`, :class:`SamplingParams`);
- :mod:`shared.schemas.trajectories`: flywheel.trajectories (:class:`Trajectory`, :class:`VersionSpan`,
  :class:`Attestation`, :class:`CanaryScore`, :class:`Reward`);
- :mod:`shared.schemas.scored`: flywheel.scored and flywheel.rewards (:class:`ScoredTrajectory`,
  :class:`TrainSample`, :class:`ScoredReward`, :class:`RewardEvent`);
- :mod:`shared.schemas.weights`: flywheel.weights (:class:`WeightUpdate`, :class:`TensorInfo`,
  :class:`AdapterInfo`);
- :mod:`shared.schemas.operations`: flywheel.metrics, flywheel.group_drops, flywheel.alerts,
  flywheel.control and flywheel.dlq (:class:`Metrics`, :class:`GroupDropped`, :class:`Alert`,
  :class:`Control`, :class:`DeadLetter`).

The task schema's verifier specs (``shared.verifier_specs``) are exported here too.
"""

from __future__ import annotations

from shared.jsoncheck import MAX_JSON_DEPTH
from shared.schemas.base import DecodeError, R, Record, decode, require_utf8
from shared.schemas.operations import (
    Alert,
    Control,
    ControlCommand,
    DeadLetter,
    DropReason,
    GroupDropped,
    Metrics,
    Severity,
)
from shared.schemas.scored import (
    TRAIN_SAMPLE_FIELDS,
    RewardEvent,
    ScoredReward,
    ScoredTrajectory,
    TrainSample,
)
from shared.schemas.tasks import (
    MAX_MESSAGE_CHARS,
    MAX_METADATA_BYTES,
    ChatMessage,
    RolloutRequest,
    SamplingParams,
    Task,
    TaskBody,
    check_task_id,
)
from shared.schemas.trajectories import Attestation, CanaryScore, Reward, Trajectory, VersionSpan
from shared.schemas.weights import AdapterInfo, TensorInfo, WeightUpdate
from shared.verifier_specs import (
    ExactSpec,
    GeometrySpec,
    JsonFieldsSpec,
    MathSpec,
    NumericSpec,
    ReasoningGymSpec,
    Recipe,
    RegexSpec,
    UnitTestsSpec,
    VerifierSpec,
)

__all__ = [
    "MAX_JSON_DEPTH", "MAX_MESSAGE_CHARS", "MAX_METADATA_BYTES", "TRAIN_SAMPLE_FIELDS",
    "AdapterInfo", "Alert", "Attestation", "CanaryScore", "ChatMessage", "Control", "ControlCommand", "DeadLetter",
    "DecodeError", "DropReason", "GroupDropped", "Metrics", "R", "Record", "Reward", "RewardEvent", "RolloutRequest",
    "SamplingParams", "ScoredReward", "ScoredTrajectory", "Severity", "Task", "TaskBody", "TensorInfo", "TrainSample",
    "Trajectory", "VersionSpan", "WeightUpdate", "check_task_id", "decode", "require_utf8",
    "ExactSpec", "GeometrySpec", "JsonFieldsSpec", "MathSpec", "NumericSpec", "ReasoningGymSpec", "Recipe",
    "RegexSpec", "UnitTestsSpec", "VerifierSpec",
]
