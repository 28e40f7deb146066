"""Message schemas: one record type per topic (DESIGN.md, "Topics and messages").

Every record is one JSON object encoded with orjson, carrying ``schema`` (its name) and
``schema_version``. :func:`decode` validates; a record that fails goes to
flywheel.dlq as a :class:`DeadLetter` with the reason (see ``shared.kafka``).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.jsoncheck import MAX_JSON_DEPTH  # noqa: F401 - re-exported
from shared.jsoncheck import check_json as _check_json
from shared.jsoncheck import check_size as _check_size
from shared.topics import POOL_PATTERN
from shared.verifier_specs import (  # noqa: F401 - re-exported: the task schema's verifier specs
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

# ---------------------------------------------------------------- task-level pieces

MAX_MESSAGE_CHARS = 100_000
"""Longest chat message accepted (characters); longer prompts cannot fit a policy's context anyway."""
MAX_METADATA_BYTES = 1024 * 1024
"""Largest ``metadata`` of a task (bytes of compact JSON)."""


def _non_utf8_path(value: Any) -> str | None:
    """Path (``a.0.b``) of the first string or key in ``value`` that cannot be UTF-8 encoded (a lone
    surrogate such as ``"\\ud800"`` in JSON), or None when every one can."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:  # the path may hold the bad key itself: show it escaped
                return (path or "(value)").encode("utf-8", "backslashreplace").decode("utf-8")
        elif isinstance(v, dict):
            for k, c in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str):
                    stack.append((k, sub))
                stack.append((c, sub))
        elif isinstance(v, (list, tuple)):
            stack.extend((c, f"{path}.{i}" if path else str(i)) for i, c in enumerate(v))
    return None


def require_utf8(data: Any) -> Any:
    """``data`` unchanged; for a ``mode="before"`` model validator.

    Raises:
        ValueError: a string or key in ``data`` is not valid UTF-8 text; the message names its path.
    """
    bad = _non_utf8_path(data)
    if bad is not None:
        raise ValueError(f"{bad}: not valid UTF-8 text (a lone surrogate code point)")
    return data


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


# ---------------------------------------------------------------- records


def _record_json_schema(schema: dict[str, Any], cls: type) -> None:
    """Pydantic ``json_schema_extra`` hook of :class:`Record`: in a record's JSON Schema, ``schema`` and
    ``schema_version`` are the record's own constants (the model fields default to the base's) and required,
    as every encoded record carries them (``docs/schemas/``, ``shared.schema_export``)."""
    props = schema.setdefault("properties", {})
    props["schema"] = {"const": cls.SCHEMA, "default": cls.SCHEMA, "title": "Schema", "type": "string",
                       "description": "The record's schema name."}
    props["schema_version"] = {"const": cls.VERSION, "default": cls.VERSION, "title": "Schema Version",
                               "type": "integer", "description": "The record's schema version (decoders accept "
                               "only their own)."}
    rest = [r for r in schema.get("required", []) if r not in ("schema", "schema_version")]
    schema["required"] = ["schema", "schema_version", *rest]


class Record(BaseModel):
    """Base of every Kafka record: a schema name and version travel in each JSON object.

    Unknown fields are rejected (``extra="forbid"``): a record with a field this version does not know fails
    :func:`decode` and goes to the DLQ (``docs/schemas/README.md``, "Compatibility").
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, json_schema_extra=_record_json_schema)
    SCHEMA: ClassVar[str] = "record"
    VERSION: ClassVar[int] = 1
    schema_: str = Field("record", alias="schema")
    schema_version: int = 1

    def __init__(self, **data: Any) -> None:
        data.setdefault("schema", self.SCHEMA)
        data.setdefault("schema_version", self.VERSION)
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _check_schema(cls, data: Any) -> Any:
        if isinstance(data, dict):
            name, ver = data.get("schema", cls.SCHEMA), data.get("schema_version", cls.VERSION)
            if name != cls.SCHEMA:
                raise ValueError(f"schema is {name!r}, expected {cls.SCHEMA!r}")
            if ver != cls.VERSION:
                raise ValueError(f"schema version {ver} of {cls.SCHEMA!r} is not supported (want {cls.VERSION})")
        return data

    def encode(self) -> bytes:
        """The record as one orjson-encoded JSON object."""
        return orjson.dumps(self.model_dump(mode="json", by_alias=True))


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
    a Task, are version 2 with it."""

    SCHEMA: ClassVar[str] = "flywheel.Task"
    VERSION: ClassVar[int] = 2
    task_id: str = Field(min_length=1, max_length=512)

    @field_validator("task_id")
    @classmethod
    def _url_safe(cls, v: str) -> str:
        return check_task_id(v)


class RolloutRequest(Record):
    """flywheel.rollout.requests, key group_id. Producer: scheduler. Consumer: rollout."""

    SCHEMA: ClassVar[str] = "flywheel.RolloutRequest"
    VERSION: ClassVar[int] = 2
    group_id: str
    task: Task
    n: int = Field(ge=1, le=1024)
    sampling: SamplingParams
    purpose: Literal["train", "eval"] = "train"
    attempt: int = Field(1, ge=1)
    min_policy_version: int = Field(0, ge=0)
    eval_round: int | None = None
    issued_at: float = Field(default_factory=time.time)


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
    VERSION: ClassVar[int] = 2
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


class TensorInfo(BaseModel):
    """One entry of a weight manifest."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    name: str
    shape: list[int]
    dtype: str


class AdapterInfo(BaseModel):
    """A policy version published as a LoRA adapter over the frozen base model (``trainer.lora``,
    ``shared/lora.py``): each module's weight is W + (alpha / r) · B A."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    kind: Literal["lora"] = "lora"
    r: int = Field(ge=1, le=4096)
    """Rank of every adapter."""
    alpha: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    """LoRA's alpha: the update is scaled by alpha / r."""
    target_modules: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(min_length=1, max_length=100_000)
    """Paths of the adapted linear modules in the base model (``model.layers.0.self_attn.q_proj``...)."""

    @property
    def scale(self) -> float:
        """alpha / r, the factor of B A."""
        return self.alpha / self.r


class WeightUpdate(Record):
    """flywheel.weights, key model name. Producer: trainer. Consumers: rollout (every replica), scheduler."""

    SCHEMA: ClassVar[str] = "flywheel.WeightUpdate"
    model: str
    version: int = Field(ge=0, le=2**53)
    step: int = Field(ge=0, le=2**53)
    transport: Literal["checkpoint", "distributed"] = "checkpoint"
    path: str | None = None
    """Safetensors file of this version in the checkpoint store (transport ``checkpoint``)."""
    manifest: list[TensorInfo]
    checksum: str
    """``<algorithm>:<hex>`` of the safetensors file: ``xxh3_128`` (what the trainer writes) or ``sha256`` (older records)
    (``shared.checkpoint.CHECKSUMS``)."""
    receivers: list[str] = Field(default_factory=list, max_length=4096)
    """Transport ``distributed``: the rollout engines in this version's broadcast session (the others,
    and any whose session fails, load the safetensors file)."""
    adapter: AdapterInfo | None = None
    """Set when the version is a LoRA adapter (``path`` then names its ``adapter_model.safetensors``, in peft's
    layout); None: ``path`` holds the full weights."""
    created_at: float = Field(default_factory=time.time)


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
    """Signal name (docs/guide.md, "Drift monitoring"): ``pass_rate_jump``, ``truncation_rate``, ``breaker``..."""
    status: Literal["firing", "resolved"] = "firing"
    severity: Severity = "warning"
    value: float | None = None
    """The signal's value over the window (units per signal; docs/guide.md)."""
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


R = TypeVar("R", bound=Record)


class DecodeError(ValueError):
    """A record that is not valid JSON or fails its schema; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode(raw: bytes | None, cls: type[R]) -> R:
    """Parse and validate one record of type ``cls``.

    Raises:
        DecodeError: the bytes are not a JSON object or fail validation (the reason names the field).
    """
    if raw is None:
        raise DecodeError("empty record value")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise DecodeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"not a JSON object but {type(obj).__name__}")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, er['loc'])) or '<root>'}: {er['msg']}" for er in e.errors()[:5])
        raise DecodeError(f"{cls.SCHEMA} v{cls.VERSION} validation failed: {errs}") from None
