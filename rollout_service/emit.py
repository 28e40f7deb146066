"""Trajectory emission of the rollout service: one path for plain and multi-turn (tool) samples.

A generated sample (:class:`rollout_service.engine.Sample`) or a tool-loop trajectory
(:class:`rollout_service.tool_loop.Rollout`) becomes a :class:`Completion`; the completions of one
request form a :class:`Group`; :func:`publish` turns groups into :class:`shared.schemas.Trajectory`
records on flywheel.trajectories (key ``group_id``, one ``rollout`` trace span per group, parented on
the request's trace context), waits for every ack, and counts them in :class:`RolloutStats`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from opentelemetry import trace

from rollout_service.batching import Headers
from rollout_service.engine import Sample
from rollout_service.tool_loop import Rollout
from shared import kafka, topics
from shared.schemas import Attestation, RolloutRequest, Trajectory, VersionSpan
from shared.telemetry import extract_context, inject_headers

if TYPE_CHECKING:
    from rollout_service.metrics import RolloutMetrics

log = logging.getLogger("rollout")

Attest = Callable[[list[int]], Attestation | None]
"""The engine's :meth:`~rollout_service.engine.Engine.attestation`: canary scores for the given versions."""


@dataclass
class Completion:
    """One sample's completion, after the prompt: ``ids[i]`` with behaviour log-prob ``logprobs[i]``
    (natural log; 0 on tool output) and ``mask[i]`` (1 generated, 0 tool output); ``versions`` are the
    policy-version spans over ``ids``; ``turns`` the per-turn records of a multi-turn trajectory
    (empty for a plain sample). ``tool_seconds`` is wall time in the sandbox."""

    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finish_reason: str
    versions: list[VersionSpan]
    generated_tokens: int
    error: str | None = None
    turns: list[dict[str, Any]] = field(default_factory=list)
    tool_rounds: int = 0
    tool_seconds: float = 0.0
    state: dict[str, Any] | None = None

    @classmethod
    def from_sample(cls, s: Sample) -> Completion:
        """A plain (single-turn) sample: every token generated and trained."""
        return cls(s.completion_ids, s.logprobs, [1] * len(s.completion_ids), s.finish_reason, s.versions,
                   len(s.completion_ids), error=s.error)

    @classmethod
    def from_rollout(cls, ro: Rollout, policy_version: int, state: dict[str, Any] | None = None,
                     error: str | None = None) -> Completion:
        """A tool-loop or environment trajectory (``state``: the environment's, ``error``: why it is an error
        sample); without version spans (nothing generated) it is tagged with an empty span of
        ``policy_version``."""
        return cls(ro.ids, ro.logprobs, ro.mask, "error" if error else ro.finish_reason,
                   ro.versions or [VersionSpan(version=policy_version, start=0, end=0)], ro.generated_tokens,
                   error=error, turns=ro.turns, tool_rounds=ro.tool_rounds, tool_seconds=ro.tool_seconds,
                   state=state)

    @property
    def cost(self) -> dict[str, float]:
        """``Trajectory.cost``: generated tokens, tool rounds and tool seconds."""
        return {"generated_tokens": float(self.generated_tokens), "tool_rounds": float(self.tool_rounds),
                "tool_seconds": self.tool_seconds}


@dataclass
class Group:
    """The completions of one request, sample ``i`` of the group being ``completions[i]``.

    ``headers`` are the request record's (trace context); ``timings`` the seconds of ``queue`` (request
    issued → picked up) and ``generate``.
    """

    request: RolloutRequest
    headers: Headers | None
    prompt_ids: list[int]
    completions: list[Completion]
    timings: dict[str, float]


@dataclass
class RolloutStats:
    """Running totals of one service run (sample counts, tokens, seconds), sent as ``rollout/*`` metrics."""

    samples: float = 0.0
    tokens: float = 0.0
    """Generated tokens (tool output excluded)."""
    generate_s: float = 0.0
    """Seconds spent generating (a tool group's include its tool calls and its acks)."""
    tool_rounds: float = 0.0
    tool_seconds: float = 0.0
    publish_to_first_token_s: float | None = None
    """Seconds from the announcement of the newest version to the first batch generated with it."""
    busy_s: float = 0.0
    """Seconds the engine spent generating (holding the :class:`rollout_service.engine.EngineGate`)."""
    started: float | None = None
    """``time.perf_counter()`` when the service started taking requests (:meth:`start`)."""
    sink: RolloutMetrics | None = None
    """Prometheus families fed with every engine call, published sample and refused request (``None``: none)."""
    unproducible: list[tuple[RolloutRequest, str]] = field(default_factory=list)
    """Requests one of whose trajectories could not be produced, with the reason, since the service loop
    last took them (it dead-letters their source records: :func:`publish`)."""

    def start(self) -> None:
        """Mark now as the start of ``rollout/wall_s``."""
        self.started = time.perf_counter()

    def add_busy(self, seconds: float) -> None:
        """Count ``seconds`` of engine time (the gate's ``on_busy``: one generate call)."""
        self.busy_s += seconds
        if self.sink is not None:
            self.sink.generate_seconds.observe(seconds)

    def utilisation(self) -> dict[str, float]:
        """``rollout/busy_s``, ``rollout/wall_s`` (seconds since :meth:`start`) and ``rollout/idle_fraction``
        = 1 − busy / wall, clipped to [0, 1] (0 while no time has passed); empty before :meth:`start`."""
        if self.started is None:
            return {}
        wall = time.perf_counter() - self.started
        idle = min(1.0, max(0.0, 1.0 - self.busy_s / wall)) if wall > 0 else 0.0
        return {"rollout/busy_s": self.busy_s, "rollout/wall_s": wall, "rollout/idle_fraction": idle}

    def add(self, c: Completion, request: RolloutRequest | None = None) -> None:
        """Count one published completion (of ``request``, which labels it in :attr:`sink`)."""
        if self.sink is not None and request is not None:
            self.sink.published(request.task.domain, request.purpose, c.finish_reason, c.generated_tokens)
        self.samples += 1
        self.tokens += c.generated_tokens
        self.tool_rounds += c.tool_rounds
        self.tool_seconds += c.tool_seconds

    def metrics(self, policy_version: int) -> dict[str, float]:
        """The ``rollout/*`` metric values: totals, throughput (generated tokens per generation second),
        the engine's ``policy_version``, the running cost per sample (call once ``samples > 0``) and the
        engine's utilisation (:meth:`utilisation`)."""
        n = max(self.samples, 1.0)
        vals = {"rollout/samples": self.samples, "rollout/tokens": self.tokens, "rollout/generate_s": self.generate_s,
                "rollout/tool_rounds": self.tool_rounds, "rollout/tool_seconds": self.tool_seconds}
        if self.publish_to_first_token_s is not None:
            vals["rollout/publish_to_first_token_s"] = self.publish_to_first_token_s
        vals.update(self.utilisation())
        return dict(vals, **{"rollout/tokens_per_s": self.tokens / max(self.generate_s, 1e-9),
                             "rollout/policy_version": float(policy_version),
                             # running cost per sample: the inference line of a training budget
                             "rollout/tokens_per_sample": self.tokens / n,
                             "rollout/tool_rounds_per_sample": self.tool_rounds / n,
                             "rollout/tool_seconds_per_sample": self.tool_seconds / n})


def make_trajectory(group: Group, i: int, tokenizer, attest: Attest | None = None) -> Trajectory:
    """Sample ``i`` of ``group`` as a Trajectory (id ``<group_id>:<attempt>:<i>``; the text is the
    completion decoded without special tokens), with ``attest``'s attestation for the versions of its spans
    (:meth:`rollout_service.engine.Engine.attestation`; none without it).

    Raises:
        pydantic.ValidationError: ids, log-probs and mask differ in length.
    """
    req, c = group.request, group.completions[i]
    return Trajectory(
        trajectory_id=f"{req.group_id}:{req.attempt}:{i}", group_id=req.group_id, sample_index=i,
        group_size=req.n, task=req.task, purpose=req.purpose, attempt=req.attempt, eval_round=req.eval_round,
        prompt_ids=group.prompt_ids, completion_ids=c.ids, completion_logprobs=c.logprobs, loss_mask=c.mask,
        completion_text=tokenizer.decode(c.ids, skip_special_tokens=True), finish_reason=c.finish_reason,
        error=c.error, policy_versions=c.versions, temperature=req.sampling.temperature, timings=group.timings,
        turns=c.turns, cost=c.cost, state=c.state, attestation=attest([v.version for v in c.versions]) if attest else None,
    )


async def publish(producer: AIOKafkaProducer, tokenizer, groups: list[Group], policy_version: int,
                  stats: RolloutStats, attest: Attest | None = None) -> None:
    """Send one Trajectory per completion of every group to flywheel.trajectories, then wait for all
    the acks (the caller commits the requests after this returns).

    Each group's records are sent inside a ``rollout`` span parented on its request's trace context (the
    scheduler's ``issue_group`` span), starting when the request was picked up (``issued_at`` + the
    ``queue`` timing), so it covers generation and publishing; attributes ``group_id``, ``domain``,
    ``purpose``, ``n``, ``policy_version`` (the engine's version now), ``queue_s`` and ``generate_s``.

    A trajectory that can never be produced (over ``kafka.max_request_size``, checked before sending, or
    refused by the broker: :data:`shared.kafka.PERMANENT_PRODUCE_ERRORS`) is replaced by its small
    ``error`` stand-in (:func:`shared.kafka.unproducible_trajectory`: the verifier scores it as an
    infrastructure error, the trainer drops the group as ``failed`` and the scheduler gets the slot back
    at once), and its request is added to ``stats.unproducible`` for the service loop to dead-letter.

    Raises:
        aiokafka.errors.KafkaError: a record was not acknowledged for a transient reason (nothing is
            committed then).
    """
    out: list[kafka.Outgoing] = []
    meta: list[tuple[Trajectory, RolloutRequest]] = []
    tracer = trace.get_tracer("rollout")
    limit = getattr(producer, "_max_request_size", None)
    for g in groups:
        r = g.request
        key = r.group_id.encode()
        picked_ns = min(time.time_ns(), int((r.issued_at + g.timings.get("queue", 0.0)) * 1e9))
        attrs = {"group_id": r.group_id, "domain": r.task.domain, "purpose": r.purpose, "n": r.n,
                 "policy_version": policy_version, "queue_s": g.timings.get("queue", 0.0),
                 "generate_s": g.timings.get("generate", 0.0)}
        with tracer.start_as_current_span("rollout", context=extract_context(g.headers), attributes=attrs,
                                          start_time=picked_ns):
            headers = inject_headers()
            for i, c in enumerate(g.completions):
                traj = make_trajectory(g, i, tokenizer, attest)
                value = traj.encode()
                size = kafka.record_size(value, key, headers)
                if limit is not None and size > limit:
                    reason = (f"unproducible: MessageSizeTooLargeError: trajectory {traj.trajectory_id} for "
                              f"{topics.TRAJECTORIES} is {size} bytes, over kafka.max_request_size={limit}")
                    traj = _unproducible(traj, reason, r, stats)
                    value = traj.encode()
                    if not _fits(producer, value, key):  # a huge task: only the dead letter says it
                        log.error("group %s: even the error stand-in of %s is too large; not sent", r.group_id,
                                  traj.trajectory_id)
                        continue
                out.append((topics.TRAJECTORIES, value, key, headers))
                meta.append((traj, r))
                stats.add(c, r)
    errors = await kafka.produce_all(producer, out)
    retry: list[kafka.Outgoing] = []
    for (topic, _, key, headers), (traj, r), e in zip(out, meta, errors):
        if e is not None:
            reason = (f"unproducible: {type(e).__name__}: trajectory {traj.trajectory_id} for {topics.TRAJECTORIES} "
                      f"refused: {e}")[:2000]
            retry.append((topic, _unproducible(traj, reason, r, stats).encode(), key, headers))
    if retry:
        await kafka.produce_all(producer, retry)


def _unproducible(traj: Trajectory, reason: str, request: RolloutRequest, stats: RolloutStats) -> Trajectory:
    """Log ``reason``, remember ``request`` for dead-lettering, and return ``traj``'s small stand-in."""
    log.error("group %s: %s; sending an error trajectory in its place", request.group_id, reason)
    if not any(req is request for req, _ in stats.unproducible):
        stats.unproducible.append((request, reason))
    return kafka.unproducible_trajectory(traj, reason)


def _fits(producer: AIOKafkaProducer, value: bytes, key: bytes) -> bool:
    """Whether a record of ``value`` is within the producer's ``max_request_size``."""
    limit = getattr(producer, "_max_request_size", None)
    return limit is None or kafka.record_size(value, key) <= limit
