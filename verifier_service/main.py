"""The verifier service: flywheel.trajectories in, flywheel.scored and flywheel.rewards out.

At-least-once (DESIGN.md, "Delivery semantics"): a batch's offsets are committed only after
every ScoredTrajectory, RewardEvent and dead letter it produced is acknowledged. The service is
stateless; a redelivered trajectory is scored again and deduplicated downstream by trajectory_id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import ConsumerRecord
from opentelemetry import trace

from shared import topics
from shared.kafka import (
    BROKER_ERRORS,
    BrokerLost,
    BrokerWatch,
    Outgoing,
    commit_batch,
    dead_letter,
    ensure_topics,
    make_consumer,
    make_producer,
    prepare_service,
    produce_all,
    reconnect_pause,
    record_size,
    send,
    stop_clients,
    unproducible_trajectory,
)
from shared.metrics import serve_metrics
from shared.schemas import DecodeError, Metrics, Reward, RewardEvent, ScoredTrajectory, Trajectory
from shared.telemetry import extract_context, flush_tracing, inject_headers, recording, trace_headers
from verifier_service.config import VerifierConfig, VerifierSettings
from verifier_service.intake import TrajectoryDecoder
from verifier_service.metrics import VerifierMetrics
from verifier_service.scorers import Scorer

SERVICE = "verifier"
log = logging.getLogger(__name__)


async def score_with_retries(scorer: Scorer, cfg: VerifierConfig, traj: Trajectory,
                             cost: dict[str, float] | None = None) -> Reward:
    """Score one trajectory, retrying infrastructure failures up to ``cfg.infra_retries`` times.

    The sleep before retry ``i`` (0-based) is ``retry_backoff_s * 2**i`` seconds. Trajectories that
    ended with finish_reason ``error``/``abort`` are not scored: infra_error with the reason. A
    misconfigured spec (``details.misconfigured``) is not retried.

    ``cost``, when given, receives what scoring cost over every attempt: ``verify_seconds`` (seconds in
    the scorer, backoff sleeps not counted; absent when nothing was scored), and from the scorer
    ``sandbox_seconds`` and ``judge_calls`` (see :meth:`Scorer.score`).
    """
    cost = {} if cost is None else cost
    if traj.finish_reason in ("error", "abort"):
        return Reward(
            total=0.0, infra_error=True,
            details={"reason": f"generation ended with finish_reason={traj.finish_reason}", "error": traj.error},
        )
    attempts = 0
    while True:
        t0 = time.perf_counter()
        try:
            reward = await scorer.score(
                traj.task.verifier, traj.completion_text, finish_reason=traj.finish_reason,
                prompt=[m.model_dump() for m in traj.task.prompt], tools=traj.task.tools, domain=traj.task.domain,
                cost=cost, rollout=rollout_context(traj))
        finally:
            cost["verify_seconds"] = cost.get("verify_seconds", 0.0) + time.perf_counter() - t0
        attempts += 1
        if not reward.infra_error or reward.details.get("misconfigured") or attempts > cfg.infra_retries:
            break
        delay = cfg.retry_backoff_s * 2 ** (attempts - 1)
        log.info("retrying %s in %.1f s after infra error (%d/%d): %s", traj.trajectory_id, delay, attempts,
                 cfg.infra_retries, reward.details.get("reason"))
        await asyncio.sleep(delay)
    if reward.infra_error:
        reward.details["attempts"] = attempts
    return reward


def rollout_context(traj: Trajectory) -> dict:
    """What an environment's rewards see of a rollout beyond its text: the environment's ``state``, the
    ``tool_calls`` of every turn, and the ``turns`` (``{role, text}``); for a multi-turn rollout the
    ``completion`` they get is its last assistant turn."""
    turns = [{"role": t.get("role"), "text": t.get("text", "")} for t in traj.turns]
    last = next((t["text"] for t in reversed(turns) if t["role"] == "assistant"), None)
    return {"state": traj.state or {}, "turns": turns, "completion": last,
            "tool_calls": [c for t in traj.turns for c in t.get("tool_calls") or []]}


def sample_cost(traj: Trajectory, verifier_cost: dict[str, float] | None = None) -> dict[str, float]:
    """``RewardEvent.cost`` of ``traj``: the trajectory's own ``cost`` (``generated_tokens``, ``tool_rounds``,
    ``tool_seconds``; ``generated_tokens`` is Σ ``loss_mask``, the generated tokens, when the trajectory
    has none) plus ``verifier_cost`` (``sandbox_seconds``, ``judge_calls``, ``verify_seconds``, as
    :func:`score_with_retries` fills it). Values not known are absent, never guessed."""
    cost = {k: float(v) for k, v in traj.cost.items()}
    cost.setdefault("generated_tokens", float(sum(traj.loss_mask)))
    cost.update({k: float(v) for k, v in (verifier_cost or {}).items()})
    return cost


def reward_event(traj: Trajectory, reward: Reward, verifier_cost: dict[str, float] | None = None,
                 scored_at: float | None = None) -> RewardEvent:
    """The light flywheel.rewards summary of one scored trajectory, with its :func:`sample_cost`.

    For analysts it carries ``event_time`` (``scored_at``, Unix seconds; now when not given), the spec's
    ``verifier_kind``, the reward's ``components`` (every layer computed, before gates and weights), the
    ``gates`` that fired (``details.gated_by``) and the ``hacks`` flagged (``details.hacks``).
    """
    t = traj.task
    return RewardEvent(
        task_id=t.task_id, group_id=traj.group_id, trajectory_id=traj.trajectory_id,
        sample_index=traj.sample_index, group_size=traj.group_size, domain=t.domain, difficulty=t.difficulty,
        purpose=traj.purpose, attempt=traj.attempt, eval_round=traj.eval_round, reward=reward.total,
        passed=reward.passed, infra_error=reward.infra_error,
        misconfigured=bool(reward.infra_error and reward.details.get("misconfigured")),
        reason=str(reward.details.get("reason"))[:500] if reward.infra_error else None,
        completion_tokens=len(traj.completion_ids), finish_reason=traj.finish_reason,
        policy_version=traj.behaviour_version, cost=sample_cost(traj, verifier_cost),
        completion_hash=completion_hash(traj.completion_text), surprisal=surprisal(traj),
        hacks=sorted(reward.details.get("hacks", {}))[:32],
        event_time=time.time() if scored_at is None else scored_at, verifier_kind=t.verifier.kind,
        components={str(k): float(v) for k, v in list(reward.components.items())[:64] if math.isfinite(v)},
        gates=[str(g) for g in reward.details.get("gated_by", [])][:32],
        metrics=environment_metrics(reward.details),
    )


def environment_metrics(details: dict) -> dict[str, float]:
    """The reward functions' values and named metrics of an ``environment`` reward (finite floats, at most 64)."""
    found = {**{k: v for k, v in (details.get("rewards") or {}).items() if v is not None},
             **(details.get("metrics") or {})}
    return {str(k)[:128]: float(v) for k, v in list(found.items())[:64]
            if isinstance(v, (int, float)) and math.isfinite(v)}


_SPACE = re.compile(r"\s+")


def completion_hash(text: str) -> str:
    """16 hex digits of the BLAKE2b hash of ``text`` with whitespace runs collapsed to one space, ends
    stripped and case folded: equal for completions that differ only in spacing or case."""
    norm = _SPACE.sub(" ", text).strip().casefold()
    return hashlib.blake2b(norm.encode("utf-8", "replace"), digest_size=8).hexdigest()


def surprisal(traj: Trajectory) -> float | None:
    """Mean −log-prob (nats) of ``traj``'s generated tokens (``loss_mask`` 1) under the behaviour policy,
    ``None`` when it has none. At temperature 1 this is an unbiased estimate of the policy's per-token
    entropy on the states visited."""
    lps = [lp for lp, m in zip(traj.completion_logprobs, traj.loss_mask) if m]
    if not lps:
        return None
    v = -sum(lps) / len(lps)
    return max(0.0, v) if math.isfinite(v) else None


class _Counters:
    def __init__(self) -> None:
        self.values: dict[str, float] = {
            "verifier/scored": 0, "verifier/passed": 0, "verifier/infra_errors": 0, "verifier/dlq": 0,
            "verifier/batches": 0, "verifier/score_seconds_total": 0.0,
        }

    def add(self, name: str, v: float = 1) -> None:
        key = f"verifier/{name}"
        self.values[key] = self.values.get(key, 0) + v

    def snapshot(self) -> dict[str, float]:
        out = dict(self.values)
        n = out["verifier/scored"]
        out["verifier/score_seconds_mean"] = out["verifier/score_seconds_total"] / n if n else 0.0
        return out


@dataclass
class _Outcome:
    """One trajectory of a batch, scored and not yet produced (:func:`_score`, then :func:`_produce_batch`)."""

    msg: ConsumerRecord
    traj: Trajectory
    reward: Reward
    cost: dict[str, float]
    seconds: float
    """Seconds in :func:`score_with_retries`."""
    scored_at: float
    """Unix seconds when scoring ended (``RewardEvent.event_time``)."""
    span: Any
    """Its ``verify`` span (ended once its records are acknowledged; ``INVALID_SPAN`` with traces off)."""
    headers: list[tuple[str, bytes]]
    """The trace context its records carry: the span's, or with traces off the source record's."""


async def _score(msg: ConsumerRecord, producer: Any, scorer: Scorer, cfg: VerifierConfig, tracer: trace.Tracer,
                 counters: _Counters, prom: VerifierMetrics | None, decoder: TrajectoryDecoder) -> _Outcome | None:
    """Decode and score one record; ``None`` when it was malformed (dead-lettered and counted)."""
    try:
        traj = decoder.decode(msg.value)
    except DecodeError as e:
        await dead_letter(producer, msg, SERVICE, e.reason)
        counters.add("dlq")
        if prom is not None:
            prom.dlq.labels(msg.topic).inc()
        return None
    cost: dict[str, float] = {}
    if not recording():  # traces off: no span (about 60 µs a record); the record's trace context goes on as is
        t0 = time.perf_counter()
        reward = await score_with_retries(scorer, cfg, traj, cost)
        return _Outcome(msg, traj, reward, cost, time.perf_counter() - t0, time.time(), trace.INVALID_SPAN,
                        trace_headers(msg.headers))
    span = tracer.start_span(
        "verify", context=extract_context(msg.headers),
        attributes={"trajectory_id": traj.trajectory_id, "group_id": traj.group_id, "domain": traj.task.domain,
                    "sample_index": traj.sample_index, "verifier.kind": traj.task.verifier.kind})
    with trace.use_span(span, end_on_exit=False):
        t0 = time.perf_counter()
        reward = await score_with_retries(scorer, cfg, traj, cost)
        dt, scored_at = time.perf_counter() - t0, time.time()
        headers = inject_headers()
    span.set_attribute("reward", reward.total)
    span.set_attribute("infra_error", reward.infra_error)
    span.set_attribute("passed", reward.passed)
    return _Outcome(msg, traj, reward, cost, dt, scored_at, span, headers)


async def _produce_batch(producer: Any, outcomes: list[_Outcome], counters: _Counters,
                         prom: VerifierMetrics | None) -> None:
    """Produce every outcome's ScoredTrajectory (key group_id) and RewardEvent (key task_id) in batches
    (:func:`shared.kafka.produce_all`), then wait for all the acks.

    A record over ``max_request_size`` (checked before sending: then neither of the outcome's records is sent)
    or refused by the broker (:data:`shared.kafka.PERMANENT_PRODUCE_ERRORS`, seen on its ack) dead-letters its
    source record, which is reported downstream as a failed sample (:func:`_report_unproducible`) and committed
    past. One ``send`` per record cost about three times the CPU; thousands of concurrent ``send`` calls on a
    full batch all woke on every drain of aiokafka's accumulator (a profile of the null pipeline spent most of
    the verifier's time there).

    Raises:
        aiokafka.errors.KafkaError: a transient failure (the caller does not commit).
    """
    limit = getattr(producer, "_max_request_size", None)
    sent: list[_Outcome] = []
    out: list[Outgoing] = []
    for o in outcomes:
        traj, headers = o.traj, o.headers
        records = [(topics.SCORED, ScoredTrajectory.of(traj, o.reward).encode(), traj.group_id.encode(), headers),
                   (topics.REWARDS, reward_event(traj, o.reward, o.cost, o.scored_at).encode(),
                    traj.task.task_id.encode(), headers)]
        too_big = next(((t, n) for t, v, k, _ in records if limit is not None
                        and (n := record_size(v, k, headers)) > limit), None)
        if too_big is not None:  # neither of its records is sent: the stand-in speaks for it
            reason = (f"unproducible: MessageSizeTooLargeError: the record for {too_big[0]} is {too_big[1]} bytes, "
                      f"over kafka.max_request_size={limit}")
            await _unproducible(producer, o, reason, counters, prom)
            continue
        sent.append(o)
        out.extend(records)
    errors = await produce_all(producer, out)
    for n, o in enumerate(sent):
        reason = next((f"unproducible: {type(e).__name__}: record for {t} is {len(v)} bytes: {e}"[:2000]
                       for (t, v, _, _), e in zip(out[2 * n:2 * n + 2], errors[2 * n:2 * n + 2]) if e is not None), None)
        if reason is not None:
            await _unproducible(producer, o, reason, counters, prom)
            continue
        o.span.end()
        _count(o, counters, prom)


async def _unproducible(producer: Any, o: _Outcome, reason: str, counters: _Counters,
                        prom: VerifierMetrics | None) -> None:
    """Dead-letter ``o``'s source record with ``reason``, count it, and report the sample as failed."""
    await dead_letter(producer, o.msg, SERVICE, reason)
    o.span.set_attribute("unproducible", reason)
    o.span.end()
    counters.add("dlq")
    if prom is not None:
        prom.dlq.labels(o.msg.topic).inc()
    await _report_unproducible(producer, o.traj, reason, o.cost, o.scored_at)


def _count(o: _Outcome, counters: _Counters, prom: VerifierMetrics | None) -> None:
    """The counters, Prometheus families and debug line of one produced outcome."""
    traj, reward = o.traj, o.reward
    counters.add("scored")
    counters.add("score_seconds_total", o.seconds)
    if reward.infra_error:
        counters.add("infra_errors")
    elif reward.passed:
        counters.add("passed")
    for name in reward.details.get("hacks", {}):
        counters.add(f"hack_{name}")  # reward-hacking detectors (verifier_service/hacks/)
    for name in reward.details.get("gated_by", []):
        counters.add(f"gated_{name}")
    if prom is not None:
        prom.scored(traj, reward, o.cost)
    # per record at debug (thousands a second with cheap kinds); each batch logs one info line (_serve)
    log.debug("scored %s kind=%s reward=%.1f infra=%s in %.3f s", traj.trajectory_id, traj.task.verifier.kind,
              reward.total, reward.infra_error, o.seconds)


async def _report_unproducible(producer: Any, traj: Trajectory, reason: str, cost: dict[str, float],
                               scored_at: float) -> None:
    """After ``traj``'s scored result was dead-lettered (:func:`_produce_batch`), tell
    the pipeline the sample failed, in the records it already understands: a small ScoredTrajectory of
    :func:`shared.kafka.unproducible_trajectory` with an ``infra_error`` reward (the trainer drops the group
    as ``failed`` and announces a GroupDropped, so the scheduler gives the slot back at once) and its
    RewardEvent (``infra_error``, ``reason``). If even the stand-in is too large (a huge task), only the
    RewardEvent goes (logged).

    Raises:
        aiokafka.errors.KafkaError: a transient failure (the caller does not commit).
    """
    failed = Reward(total=0.0, infra_error=True, details={"reason": reason, "unproducible": True})
    stand_in = ScoredTrajectory.of(unproducible_trajectory(traj, reason), failed)
    out = [(topics.REWARDS, reward_event(traj, failed, cost, scored_at), traj.task.task_id)]
    if record_size(stand_in.encode(), traj.group_id) <= getattr(producer, "_max_request_size", float("inf")):
        out.insert(0, (topics.SCORED, stand_in, traj.group_id))
    else:
        log.error("trajectory %s: even its small stand-in is over kafka.max_request_size; only its RewardEvent is "
                  "sent (its group waits in the trainer)", traj.trajectory_id)
    futs = [await send(producer, t, r, k) for t, r, k in out]
    await asyncio.gather(*futs)
    log.error("trajectory %s of group %s could not be produced (%s): dead-lettered, reported as a failed sample",
              traj.trajectory_id, traj.group_id, reason)


async def _calibrate_periodically(vcfg: VerifierConfig, scorer: Scorer, producer: Any, stop: asyncio.Event) -> None:
    # ``producer`` is a zero-argument callable returning the session's current producer (it is rebuilt
    # after a broker outage).
    """Rescore the judge's labelled set every ``judge.calibration_every_s`` and publish its agreement
    (``judge/accuracy``, ``judge/mae``, ``judge/kappa``…) on flywheel.metrics; below
    ``judge.min_agreement`` log a drift alert. A failed round is logged and the loop goes on."""
    from verifier_service.judge import calibrate, load_labelled

    jc = vcfg.judge
    while not stop.is_set():
        try:
            items = await asyncio.to_thread(load_labelled, jc.calibration_file)
            report = await calibrate(scorer.judge, items, default_rubric=None)
            values = {f"judge/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float)) and v is not None}
            await (await send(producer(), topics.METRICS, Metrics(source=SERVICE, values=values), SERVICE))
            acc = report.get("accuracy")
            if acc is None or acc < jc.min_agreement:
                log.warning("ALERT judge drift: agreement %s with %d labelled items is below %.2f (%s)", acc,
                            report.get("n", 0), jc.min_agreement, report)
            else:
                log.info("judge calibration: %s", report)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed round must not stop scoring
            log.exception("judge calibration round failed")
        try:
            await asyncio.wait_for(stop.wait(), timeout=jc.calibration_every_s)
        except asyncio.TimeoutError:
            pass


async def run(config: VerifierSettings, stop: asyncio.Event | None = None) -> None:
    """Run the verifier until ``stop`` is set (SIGTERM/SIGINT set it when ``stop`` is None).

    Consumes flywheel.trajectories in group ``config.verifier.consumer_group``, scores every
    record, produces ScoredTrajectory (key group_id) and RewardEvent (key task_id), then commits.
    Malformed records go to flywheel.dlq; so does a trajectory whose scored result cannot be produced
    (too large, or refused: :func:`_produce_batch`), reported downstream as a failed
    sample (:func:`_report_unproducible`) and committed past. Publishes Metrics every
    ``metrics_interval_s`` seconds; serves Prometheus metrics (:mod:`verifier_service.metrics`) on
    ``telemetry.metrics_port`` when it is set.

    The broker may die and come back (empty) at any time: a :class:`shared.kafka.BrokerWatch` notices,
    the batch in progress is abandoned uncommitted, and the Kafka clients are rebuilt once the broker
    answers (topics re-created, the group re-joined), with a back-off of ``kafka.reconnect_backoff_ms``
    doubling to ``kafka.reconnect_backoff_max_ms`` while it does not.

    Raises:
        asyncio.CancelledError: when the task is cancelled (clients are closed first).
        aiokafka.errors.KafkaError: the broker refused something in a way no reconnect cures (e.g. an
            authentication failure); connection errors are retried, never raised.
    """
    vcfg = config.verifier
    stop, tracer = prepare_service(SERVICE, config, stop)
    scorer = Scorer(vcfg)
    counters = _Counters()
    prom = VerifierMetrics()
    metrics_server = serve_metrics(config.telemetry, prom.registry)
    watch = BrokerWatch(config.kafka, SERVICE)
    current: dict[str, Any] = {"producer": None}
    calibration = None
    try:
        attempt = 0
        while not stop.is_set():
            if not await watch.wait_up(stop):
                break
            consumer = producer = None
            try:
                epoch = watch.epoch
                await ensure_topics(config.kafka)
                consumer = make_consumer(config.kafka, topics.TRAJECTORIES, group_id=vcfg.consumer_group,
                                         client_id=SERVICE)
                producer = make_producer(config.kafka, client_id=SERVICE)
                await producer.start()
                await consumer.start()
                current["producer"] = producer
                log.info("verifier %s (group %s, sandbox %s)", "resumed" if epoch else "started", vcfg.consumer_group,
                         vcfg.sandbox_url)
                attempt = 0
                if calibration is None and vcfg.judge.calibration_file and vcfg.judge.calibration_every_s > 0:
                    calibration = asyncio.create_task(
                        _calibrate_periodically(vcfg, scorer, lambda: current["producer"], stop))
                await _serve(vcfg, consumer, producer, watch, epoch, scorer, tracer, counters, prom, stop)
            except (BrokerLost, *BROKER_ERRORS) as e:
                counters.add("broker_reconnects")
                log.warning("broker unreachable, retrying (%r); the batch in progress is not committed", e)
                await reconnect_pause(config.kafka, attempt, stop)
                attempt += 1
            finally:
                current["producer"] = None
                await stop_clients(consumer, producer)
        log.info("verifier stopping: %s", counters.snapshot())
    except asyncio.CancelledError:
        log.info("verifier cancelled")
        raise
    finally:
        if calibration is not None:
            calibration.cancel()
            await asyncio.gather(calibration, return_exceptions=True)
        await watch.close()
        await scorer.close()
        flush_tracing()
        if metrics_server is not None:
            metrics_server.close()


async def _serve(vcfg: VerifierConfig, consumer: Any, producer: Any, watch: BrokerWatch, epoch: int, scorer: Scorer,
                 tracer: trace.Tracer, counters: _Counters, prom: VerifierMetrics, stop: asyncio.Event) -> None:
    """The verifier's loop on one consumer and producer until ``stop``: take a batch, score and produce every
    record, commit; Metrics every ``metrics_interval_s``.

    Raises:
        shared.kafka.BrokerLost: the broker went away (checked before each batch and before each commit; a
            batch or commit waiting on the broker is cancelled then).
        aiokafka.errors.KafkaError: a broker error (:data:`shared.kafka.BROKER_ERRORS`).
    """
    next_metrics = time.monotonic() + vcfg.metrics_interval_s
    decoder = TrajectoryDecoder()  # a group's K trajectories share one task: validated once
    while not stop.is_set():
        watch.check(epoch)
        batch = await consumer.getmany(timeout_ms=200, max_records=vcfg.max_batch)
        if batch:
            msgs = [m for part in batch.values() for m in part]
            outcomes = await watch.guard(asyncio.gather(
                *(_score(m, producer, scorer, vcfg, tracer, counters, prom, decoder) for m in msgs)), epoch)
            await watch.guard(_produce_batch(producer, [o for o in outcomes if o is not None], counters, prom), epoch)
            watch.check(epoch)  # never commit offsets of a broker that went away meanwhile
            await watch.guard(commit_batch(consumer, batch), epoch)
            counters.add("batches")
            log.info("scored and committed a batch of %d trajectories (%s ... %s)", len(msgs),
                     (msgs[0].key or b"").decode(errors="replace"), (msgs[-1].key or b"").decode(errors="replace"))
        if time.monotonic() >= next_metrics:
            next_metrics = time.monotonic() + vcfg.metrics_interval_s
            await watch.guard(send_metrics(producer, counters), epoch)


async def send_metrics(producer: Any, counters: _Counters) -> None:
    """One Metrics record (source ``verifier``) of the running counters, acknowledged."""
    await (await send(producer, topics.METRICS, Metrics(source=SERVICE, values=counters.snapshot()), SERVICE))
