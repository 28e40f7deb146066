"""The sampler's issue loop: which groups to write and send on each pass, and sending them.

Every ``poll_interval_s`` (or at once when woken), re-issue or abandon groups past their deadline, create
automatic eval rounds, send pending eval groups, then issue new training groups while the budget allows
(:func:`training_budget`). Every group row is written to SQLite before its request is sent.

A send that fails (:meth:`IssueLoop._send`) never leaves its rows ``issued`` until the deadline: a request that
can never be produced (:data:`PERMANENT_SEND_ERRORS`, e.g. larger than the producer's limit) abandons its
group with the reason; any other failure puts the group back to ``pending`` to be retried with backoff. Sends
and acks are awaited through the sampler's broker watch: with the broker gone they fail at once
(:class:`shared.kafka.BrokerLost`) rather than after ``kafka.request_timeout_ms``.

Tasks are chosen fewest-groups-first with a seeded RNG breaking ties (epochs over the
dataset), optionally with the learnability curriculum (``scheduler.curriculum``), oversampling
(``budget.oversample``) and one larger re-sample of each unsolved group
(``budget.resample_unsolved``, written by the rewards loop when the group completes and sent
by the issue loop like a pending eval group).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time

import orjson
from aiokafka.errors import (
    InvalidTopicError, MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError,
    TopicAuthorizationFailedError, UnsupportedCodecError,
)
from opentelemetry import context as otel_context
from opentelemetry import trace

from scheduler_service.group_store import IssuedGroup
from scheduler_service.metrics_feed import count_issued
from shared import topics
from shared.kafka import BrokerLost, ensure_topics, send
from shared.schemas import RolloutRequest, SamplingParams, Task

log = logging.getLogger("scheduler_service.sampler")  # one logger for all of the sampler's loops

_AUTO_EVAL_KEY = "eval_auto_last_multiple"

PERMANENT_SEND_ERRORS = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError, InvalidTopicError,
                         TopicAuthorizationFailedError, UnsupportedCodecError)
"""Producer errors a retry cannot cure: the group is abandoned with the reason instead of retried."""
SEND_RETRY_BACKOFF_S = (1.0, 30.0)
"""Wait before re-sending a group whose send failed: first, and cap (doubling per failure), seconds."""


def training_budget(policy_version: int, batch_groups: int, max_staleness: int, max_steps: int,
                    issued: int, in_flight: int) -> int:
    """New training groups that may be issued now (never negative).

    ``batch_groups`` is the groups issued per trainer step (B, or ⌈B · oversample⌉).
    Total cap ``min(v + η + 1, max_steps) * B``; in-flight cap ``(η + 1) * B``.
    """
    total_cap = min(policy_version + max_staleness + 1, max_steps) * batch_groups
    flight_cap = (max_staleness + 1) * batch_groups
    return max(0, min(total_cap - issued, flight_cap - in_flight))


class SplicedRequest:
    """An encoded RolloutRequest (what :func:`shared.kafka.send` needs of a record: ``encode()``)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def encode(self) -> bytes:
        """The record's bytes."""
        return self.raw


class IssueLoop:
    """The issue loop of :class:`scheduler_service.sampler.Sampler` (a mixin: needs its ``cfg``, ``registry``,
    ``producer``, ``metrics``, ``rng``, ``planner``, ``maker``, ``guard``, ``stall``, ``reports``, ``watch``,
    ``_stop``, ``_making``, ``_starved_at``, ``_topics``, ``_sleep`` and ``_nap``)."""

    async def _issue_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sampler tick failed; retrying")
                await self._sleep(1.0)
            # an idle system ticks at poll_interval_s; records and REST changes wake the loop at once
            await self._nap(self.cfg.scheduler.poll_interval_s)

    async def tick(self) -> None:
        """One pass: deadlines, automatic evals, pending re-samples, the guard, the flywheel.metrics reports,
        new training groups, then pending eval groups (:meth:`_send_evals`; before the training groups with
        ``eval_timing: at_once``)."""
        sc = self.cfg.scheduler
        reissued, abandoned = self.registry.expire_groups(sc.group_deadline_s, sc.max_attempts)
        for gid in abandoned:
            log.warning("group %s abandoned after %d attempts", gid, sc.max_attempts)
        self.metrics.groups_abandoned.inc(len(abandoned))
        if reissued:
            log.info("re-issuing %d groups past their deadline", len(reissued))
            await self._send(reissued)
        self._auto_eval()
        if sc.eval_timing == "at_once":
            await self._send_evals()
        pending = self.registry.take_pending(sc.group_deadline_s, purpose="train")  # re-samples of unsolved groups
        if pending:
            await self._send(pending)
        await self.guard.tick(self._issue_probe)
        await self.reports.tick()  # finished eval rounds and the periodic gauges on flywheel.metrics
        if self.training_allowed():
            await self._issue_training()
        if sc.eval_timing == "slack":
            await self._send_evals()
        self._make_tasks()

    async def _send_evals(self) -> None:
        """Send pending eval groups (``scheduler.eval_timing``): all of them with ``at_once``; with ``slack`` a
        chunk of ``eval_chunk_groups`` once no training or eval group is in flight, or all of them once the oldest
        waiting round is ``eval_max_wait_s`` old."""
        sc = self.cfg.scheduler
        limit = 1_000_000
        if sc.eval_timing == "slack":
            oldest, eval_in_flight = self.registry.eval_backlog()
            if oldest is None:
                return
            if time.time() - oldest < sc.eval_max_wait_s:
                if eval_in_flight or self.registry.train_group_counts()[1]:
                    return  # the rollout has work the trainer waits for: evaluation fills its slack later
                limit = sc.eval_chunk_groups
        pending = self.registry.take_pending(sc.group_deadline_s, limit, purpose="eval")
        if pending:
            await self._send(pending)

    def _make_tasks(self) -> None:
        """Start one background pass of :class:`TaskMaker` when a generator domain needs tasks."""
        if self._making is not None and not self._making.done():
            return
        now = time.monotonic()
        if now - self._starved_at < 1.0:
            return
        self._starved_at = now
        rows = {d: r for d, r in self.registry.domain_rows().items() if r.config.makes_tasks and r.issuable}
        live = self.registry.next_train_tasks({d: (r.config.level, 1) for d, r in rows.items()})
        starved = {d for d, c in live.items() if not c}
        if not any(self.maker.needs(r, d in starved) for d, r in rows.items()):
            return

        async def make() -> None:
            try:
                await self._publish_tasks(await self.maker.run_needed(starved))
            except Exception:
                log.exception("making generator tasks failed")

        self._making = asyncio.create_task(make(), name="scheduler-task-maker")

    async def _publish_tasks(self, tasks: list[Task]) -> None:
        """Publish newly made tasks on flywheel.tasks (best-effort: the registry holds them; with the broker gone
        they are not sent)."""
        async def acked() -> None:
            futs = [await send(self.producer, topics.TASKS, t, key=t.task_id) for t in tasks]
            await asyncio.gather(*futs)

        try:
            await self.watch.guard(acked(), self.watch.epoch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("publishing %d generated tasks failed: %r", len(tasks), e)

    async def _issue_probe(self, task_ids: list[str]) -> list[IssuedGroup]:
        """Write and send one training group per task id: a half-open breaker's probe."""
        groups = self.registry.issue_train_groups(task_ids, self.cfg.scheduler.group_deadline_s)
        await self._send(groups)
        return groups

    def training_allowed(self) -> bool:
        """False while training is paused run-wide (``pause_training``) or the pre-training evaluation
        (round 0) is outstanding.

        Round 0 is created here at policy version 0 when ``eval_before_training`` is set, eval
        tasks exist, no round exists and no training group was issued yet.
        """
        if self.guard.training_paused:
            return False
        if not self.cfg.scheduler.eval_before_training:
            return True
        r0 = self.registry.eval_round(0)
        if r0 is None:
            issued, _ = self.registry.train_group_counts()
            if issued or self.registry.policy_version != 0 or not self.registry.task_counts()["eval"]:
                return True
            rid = self.registry.create_eval_round(0)
            log.info("created pre-training eval round %s", rid)
            return False
        return r0["done"]

    def _auto_eval(self) -> None:
        every = self.cfg.scheduler.eval_every
        if every <= 0:
            return
        v = self.registry.policy_version
        multiple = (v // every) * every
        if multiple <= 0 or multiple <= int(self.registry.kv_get(_AUTO_EVAL_KEY, 0)):
            return
        rid = self.registry.create_eval_round(v)
        self.registry.kv_set(_AUTO_EVAL_KEY, multiple)
        log.info("policy version %d: automatic eval round %s", v, rid)

    async def _issue_training(self) -> None:
        b = self.cfg.budget
        if self.registry.policy_version >= b.max_steps:
            return  # the trainer is done: a slot given back now would only generate waste
        issued, in_flight = self.registry.train_group_counts()
        per_step = math.ceil(b.batch_groups * b.oversample)
        budget = training_budget(self.registry.policy_version, per_step, b.max_staleness, b.max_steps,
                                 issued, in_flight)
        if budget > 0 and self.cfg.scheduler.curriculum == "learnability":
            replay = self._learnable(budget)
            if replay:
                groups = self.registry.issue_train_groups(replay, self.cfg.scheduler.group_deadline_s)
                budget -= len(groups)
                await self._send(groups)
        if budget > 0 and not self._stop.is_set():
            picks = self.planner.plan(budget)
            if picks:
                await self._send(self.registry.issue_train_groups(picks, self.cfg.scheduler.group_deadline_s))
            await self._watch_stall(not picks and not in_flight)

    async def _watch_stall(self, idle: bool) -> None:
        """After a pass with room for training groups: when it issued none and none is in flight, whether that
        will pass by itself (:class:`scheduler_service.stall.StallWatch`)."""
        reasons = None
        if idle and (self._making is None or self._making.done()):
            rows = self.registry.domain_rows()
            making = {d for d, r in rows.items() if r.config.makes_tasks and r.issuable and d not in self.maker.failed
                      and self.maker.needs(r, True)}
            reasons = self.planner.stall_reasons(making, set(self.maker.failed))
        alerts = self.stall.observe(reasons, self.registry.policy_version)
        for a in alerts:
            if a.status == "firing":
                self.guard.monitor.active[a.key] = a
            else:
                self.guard.monitor.active.pop(a.key, None)
        await self.guard.emit(alerts)

    def _learnable(self, budget: int) -> list[str]:
        """Up to ``replay_fraction · budget`` (stochastically rounded) partly solved tasks, drawn
        without replacement with weight p(1 − p)."""
        n = int(budget * self.cfg.scheduler.replay_fraction + self.rng.random())
        live = {d for d, r in self.registry.domain_rows().items() if r.issuable and d not in self.planner.blocked}
        cands = self.registry.learnable_train_tasks(live)
        picks: list[str] = []
        while cands and len(picks) < n:
            i = self.rng.choices(range(len(cands)), weights=[p * (1 - p) for _, p in cands])[0]
            picks.append(cands.pop(i)[0])
        return picks

    def _request(self, g: IssuedGroup) -> "SplicedRequest":
        """The RolloutRequest of ``g`` with the task's stored JSON spliced in as is (it was validated when
        registered; re-validating it 2K + 3 times per group was measurable)."""
        sc = self.cfg.scheduler
        greedy = g.purpose == "eval"
        sampling = SamplingParams(max_new_tokens=g.max_tokens or sc.max_tokens,
                                  temperature=0.0 if greedy else (sc.temperature if g.temperature is None
                                                                  else g.temperature))
        head = {"schema": RolloutRequest.SCHEMA, "schema_version": RolloutRequest.VERSION, "group_id": g.group_id,
                "n": g.n, "sampling": sampling.model_dump(mode="json"), "purpose": g.purpose, "attempt": g.attempt,
                "min_policy_version": g.min_policy_version, "eval_round": g.eval_round, "issued_at": time.time()}
        return SplicedRequest(orjson.dumps(head)[:-1] + b',"task":' + g.payload.encode() + b"}")

    async def _send(self, groups: list[IssuedGroup]) -> list[IssuedGroup]:
        """Send requests whose rows are written and wait for every ack; returns the groups sent.

        A group whose send fails is never left ``issued`` until its deadline: on one of
        :data:`PERMANENT_SEND_ERRORS` it is abandoned with the reason (``Registry.abandon_groups``), on any
        other error (broker down, timeout; with the broker seen gone :class:`shared.kafka.BrokerLost`, at once) it
        goes back to ``pending`` and a later pass re-sends it after a backoff (``Registry.release_groups``,
        :data:`SEND_RETRY_BACKOFF_S`).
        """
        if not groups:
            return []
        producer, epoch = self.producer, self.watch.epoch
        tracer = trace.get_tracer("scheduler")
        failed: dict[str, BaseException] = {}
        new = {topics.rollout_requests(g.pool) for g in groups} - self._topics
        if new:  # a pool named for the first time: its topic, with the partitions of the default one
            try:
                await ensure_topics(self.cfg.kafka, sorted(new))
                self._topics |= new
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failed.update({g.group_id: e for g in groups if topics.rollout_requests(g.pool) in new})
        futs = []
        version = self.registry.policy_version
        for g in groups:  # one trace per group, rooted here: rollout, verifier and trainer continue it via headers
            if g.group_id in failed:
                continue
            attrs = {"group_id": g.group_id, "domain": g.domain, "task_id": g.task_id, "purpose": g.purpose,
                     "attempt": g.attempt, "n": g.n, "policy_version": version}
            if g.eval_round is not None:
                attrs["eval_round"] = g.eval_round
            with tracer.start_as_current_span("issue_group", context=otel_context.Context(), attributes=attrs):
                try:
                    futs.append((g, await self.watch.guard(
                        send(producer, topics.rollout_requests(g.pool), self._request(g), key=g.group_id), epoch)))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # refused before queueing: too large, no metadata, producer closed, no broker
                    failed[g.group_id] = e
        late: set[str] = set()
        try:  # shielded: the guard gives up waiting, but a queued record is still delivered and its future settles
            results = await self.watch.guard(asyncio.gather(*(asyncio.shield(f) for _, f in futs),
                                                            return_exceptions=True), epoch)
        except BrokerLost:  # the acks that came count; a record still queued is settled by its own future
            results = []
            for g, f in futs:
                if f.done():
                    results.append(f.exception() or f.result() if not f.cancelled() else asyncio.CancelledError())
                else:
                    late.add(g.group_id)
                    f.add_done_callback(functools.partial(self._late_ack, g))
                    results.append(None)
        for (g, _), r in zip(futs, results):
            if isinstance(r, BaseException):
                failed[g.group_id] = r
        sent = [g for g in groups if g.group_id not in failed and g.group_id not in late]
        count_issued(self.metrics, sent)
        for g in sent:
            log.info("issued group %s (%s, attempt %d, n=%d)", g.group_id, g.purpose, g.attempt, g.n)
        if failed:
            self._send_failed(failed)
        return sent

    def _late_ack(self, g: IssuedGroup, fut: asyncio.Future) -> None:
        """The outcome of a request still queued when the broker was seen gone: delivered, the group stays
        ``issued``; failed, it is released for a retry like any failed send (so a request the broker accepted is
        never sent twice)."""
        e = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if e is None:
            count_issued(self.metrics, [g])
            log.info("issued group %s (%s, attempt %d, n=%d; acknowledged after the broker was seen gone)",
                     g.group_id, g.purpose, g.attempt, g.n)
        else:
            try:
                self._send_failed({g.group_id: e})
            except Exception:  # noqa: BLE001 - a callback: the registry may be closed at shutdown (the deadline re-issues)
                log.warning("group %s: its late send failure could not be recorded", g.group_id, exc_info=True)

    def _send_failed(self, failed: dict[str, BaseException]) -> None:
        """Abandon the groups whose request can never be produced; release the others for a retry."""
        permanent = {gid: f"request cannot be produced: {e!r}"[:2000] for gid, e in failed.items()
                     if isinstance(e, PERMANENT_SEND_ERRORS)}
        for gid in self.registry.abandon_groups(permanent):
            log.error("group %s abandoned: %s", gid, permanent[gid])
        self.metrics.groups_abandoned.inc(len(permanent))
        retry = [gid for gid in failed if gid not in permanent]
        if retry:
            first, cap = SEND_RETRY_BACKOFF_S
            waits = self.registry.release_groups(retry, first, cap)
            e = failed[retry[0]]
            log.warning("sending %d group(s) failed (%r); released for a retry in %.0f-%.0f s", len(retry), e,
                        min(waits.values(), default=0), max(waits.values(), default=0))
