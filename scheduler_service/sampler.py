"""The sampler: issues rollout requests under a staleness budget and consumes what comes back.

Three loops in one asyncio task group, each stopping within about one poll interval of
:meth:`Sampler.stop`:

- ``issue``: every ``poll_interval_s``, re-issue or abandon groups past their deadline, create
  automatic eval rounds, send pending eval groups, then issue new training groups while the
  budget allows (AReaL-style, DESIGN.md "Policy versions and staleness"): with policy version
  v, batch B and max staleness η, at most ``min(v + η + 1, max_steps) * B`` training groups
  issued in total (abandoned and dropped ones give their slot back; re-issues are not new) and at most
  ``(η + 1) * B`` in flight. Every group row is written to SQLite before its request is sent.
- ``rewards``: flywheel.rewards and flywheel.group_drops in the consumer group
  ``scheduler.consumer_group``; malformed records go to the DLQ; each event is counted once; a
  group the trainer dropped (stale, failed, ...) gives its budget slot back at once, so the issue
  loop sends a replacement and the run still reaches ``max_steps``; offsets are committed after SQLite.
- ``watch``: flywheel.weights and flywheel.metrics without a group, from the earliest offset:
  the highest weight version is the policy version; trainer metrics feed the history.
- ``broker``: every :data:`BROKER_CHECK_INTERVAL_S`, whether the marker topic :data:`MARKER_TOPIC` (created by
  this loop, used by nobody else) still exists. It vanishes only when the broker lost its storage (the
  embedded broker keeps everything in memory): then, like on ``POST /v1/system/broker-restarted`` from the
  supervisor, :meth:`Sampler.broker_restarted` re-creates the topics and re-issues every in-flight group at
  once instead of at its deadline (``group_deadline_s``). A scheduler that starts with in-flight groups and
  no marker does the same (the broker restarted while it was down).

A send that fails (:meth:`Sampler._send`) never leaves its rows ``issued`` until the deadline: a request that
can never be produced (:data:`PERMANENT_SEND_ERRORS`, e.g. larger than the producer's limit) abandons its
group with the reason; any other failure puts the group back to ``pending`` to be retried with backoff.

Tasks are chosen fewest-groups-first with a seeded RNG breaking ties (epochs over the
dataset), optionally with the learnability curriculum (``scheduler.curriculum``), oversampling
(``budget.oversample``) and one larger re-sample of each unsolved group
(``budget.resample_unsolved``, written by the rewards loop when the group completes and sent
by the issue loop like a pending eval group).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import (
    InvalidTopicError, MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError,
    TopicAuthorizationFailedError, UnsupportedCodecError,
)
from opentelemetry import context as otel_context
from opentelemetry import trace

from scheduler_service.config import SchedulerSettings
from scheduler_service.guard import DriftGuard
from scheduler_service.issuing import IssuePlanner, TaskMaker
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.registry import IssuedGroup, Registry, RewardOutcome
from scheduler_service.reports import Reporter
from scheduler_service.stall import StallWatch
from scheduler_service.stats import Stats
from shared import topics
from shared.kafka import commit_batch, decode_or_dead_letter, ensure_topics, make_admin, make_consumer, send
from shared.schemas import GroupDropped, Metrics, RewardEvent, RolloutRequest, SamplingParams, Task, WeightUpdate

log = logging.getLogger(__name__)

_AUTO_EVAL_KEY = "eval_auto_last_multiple"

MARKER_TOPIC = "flywheel.scheduler.marker"
"""A topic only the scheduler creates and nobody produces to: its absence means the broker lost its topics."""
BROKER_CHECK_INTERVAL_S = 5.0
"""Seconds between the sampler's checks for :data:`MARKER_TOPIC` (one metadata request each)."""
PERMANENT_SEND_ERRORS = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError, InvalidTopicError,
                         TopicAuthorizationFailedError, UnsupportedCodecError)
"""Producer errors a retry cannot cure: the group is abandoned with the reason instead of retried."""
CONSUMER_START_TIMEOUT_S = 60.0
"""Bound on starting one of the sampler's consumers (bootstrap and, for a group, the first join), seconds."""
GETMANY_SLACK_S = 5.0
"""How much longer than its own timeout one ``getmany`` may take before the loop gives up on it (a group-less
consumer whose topics vanished with the broker waits in ``Fetcher.fetched_records`` for an assignment, unbounded)."""
CONSUMER_STOP_TIMEOUT_S = 10.0
"""Bound on stopping one (leave group, close connections), seconds."""
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


class Sampler:
    """Flow control and bookkeeping of rollout groups for one scheduler process.

    Args:
        config: the scheduler's settings.
        registry: the opened task registry.
        producer: a started Kafka producer (requests, dead letters).
        stats: the process's ``GET /v1/status`` statistics, fed with every reward and metrics record.
        metrics: the process's Prometheus families (``GET /metrics``); ``None``: a private set.
    """

    def __init__(self, config: SchedulerSettings, registry: Registry, producer: AIOKafkaProducer,
                 stats: Stats, metrics: SchedulerMetrics | None = None) -> None:
        self.cfg = config
        self.registry = registry
        self.producer = producer
        self.stats = stats
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.rng = random.Random(self.cfg.scheduler.seed)
        self.planner = IssuePlanner(config, registry)
        self.maker = TaskMaker(config, registry)
        self.guard = DriftGuard(config, registry, producer, self.planner.blocked, metrics=self.metrics)
        self.stall = StallWatch(config.scheduler.stall_after_s)
        """Whether the run can go on (``run/stalled``)."""
        self.reports = Reporter(registry, stats, producer, config.scheduler.metrics_interval_s,
                                lambda: {d: b.state for d, b in self.guard.monitor.breakers.items()},
                                lambda: len(self.guard.monitor.active))
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # set by whatever may give the issue loop work: a record handled, a REST change
        self._task: asyncio.Task | None = None
        self._making: asyncio.Task | None = None
        self._starved_at = 0.0
        self._topics: set[str] = {topics.ROLLOUT_REQUESTS}
        self.name = "scheduler"
        self._restart_lock = asyncio.Lock()
        self._marker_seen = False
        self._started_at = time.time()
        self.broker_restarts = 0
        """Broker restarts handled (:meth:`broker_restarted`); the consumer loops rebuild their consumers when it
        changes (a group-less consumer keeps its old position on the new, empty topics and would skip records)."""

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the loops in the background (returns at once; the REST API serves meanwhile)."""
        self._stop.clear()
        self._started_at = time.time()
        self._task = asyncio.create_task(self._run(), name="scheduler-sampler")

    async def _first_tasks(self) -> None:
        """Make the generator domains' first tasks before the first issue decision, so the pre-training
        eval round holds their held-out sets and no domain starts starved."""
        first = {d: r.config.level for d, r in self.registry.domain_rows().items() if r.config.generator}
        if not first:
            return
        live = self.registry.next_train_tasks({d: (level, 1) for d, level in first.items()})
        t0 = time.monotonic()
        made = await self.maker.run_needed({d for d, c in live.items() if not c})
        if made:
            log.info("made %d tasks of %d generator domains in %.1f s", len(made), len(first), time.monotonic() - t0)
            await self._publish_tasks(made)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the loops to stop; cancel them when they take longer than ``timeout_s`` seconds."""
        self._stop.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except asyncio.TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        await self.guard.announce_all()
        await self._first_tasks()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._issue_loop())
            tg.create_task(self._restarting(self._rewards_loop))
            tg.create_task(self._restarting(self._watch_loop))
            tg.create_task(self._restarting(self._control_loop))
            tg.create_task(self._restarting(self._broker_loop))

    async def _restarting(self, loop) -> None:
        """Run a consumer loop until stopped, restarting it after a failure (broker down, ...) and after a
        broker restart is handled: then the running loop is cancelled wherever it waits (a fetch waiting for an
        assignment, an ack from the old broker) and started again with a new consumer."""
        while not self._stop.is_set():
            epoch = self.broker_restarts
            task = asyncio.create_task(loop(), name=f"scheduler-{loop.__name__}")
            try:
                while not task.done() and epoch == self.broker_restarts:
                    await asyncio.wait([task], timeout=0.5)
                if not task.done():  # a broker restart was handled meanwhile
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    log.info("%s: new consumer after the broker restart", loop.__name__)
                    continue
                task.result()
            except asyncio.CancelledError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            except Exception:
                log.exception("%s failed; restarting in 1 s", loop.__name__)
                await self._sleep(1.0)
            else:
                if not self._stop.is_set():
                    log.info("%s: new consumer after the broker restart", loop.__name__)

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), s)
        except asyncio.TimeoutError:
            pass

    def wake(self) -> None:
        """Have the issue loop take its next pass now rather than at ``scheduler.poll_interval_s``: called after
        every batch of records a consumer loop handled (rewards, drops, weights, control) and after every
        mutating REST request. Safe from the event loop's thread only."""
        self._wake.set()

    async def _nap(self, s: float) -> None:
        """Wait until :meth:`wake`, the stop, or ``s`` seconds, whichever comes first; clears the wake-up."""
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self._stop.wait())]
        try:
            await asyncio.wait(waits, timeout=s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self._wake.clear()

    # ------------------------------------------------------------ issuing

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
        rows = {d: r for d, r in self.registry.domain_rows().items() if r.config.generator and r.issuable}
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
        """Publish newly made tasks on flywheel.tasks (best-effort: the registry holds them)."""
        try:
            futs = [await send(self.producer, topics.TASKS, t, key=t.task_id) for t in tasks]
            await asyncio.gather(*futs)
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
            making = {d for d, r in rows.items() if r.config.generator and r.issuable and d not in self.maker.failed
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
        other error (broker down, timeout) it goes back to ``pending`` and a later pass re-sends it after a
        backoff (``Registry.release_groups``, :data:`SEND_RETRY_BACKOFF_S`).
        """
        if not groups:
            return []
        producer = self.producer
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
                    futs.append((g, await send(producer, topics.rollout_requests(g.pool), self._request(g),
                                               key=g.group_id)))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # refused before queueing: too large, no metadata, producer closed
                    failed[g.group_id] = e
        results = await asyncio.gather(*(f for _, f in futs), return_exceptions=True)
        for (g, _), r in zip(futs, results):
            if isinstance(r, BaseException):
                failed[g.group_id] = r
        sent = [g for g in groups if g.group_id not in failed]
        self.metrics.issued(sent)
        for g in sent:
            log.info("issued group %s (%s, attempt %d, n=%d)", g.group_id, g.purpose, g.attempt, g.n)
        if failed:
            self._send_failed(failed)
        return sent

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

    # ------------------------------------------------------------ broker restarts

    async def broker_restarted(self, before: float | None = None, why: str = "") -> int:
        """The broker lost its storage (restarted empty): re-create every topic (and the marker), and re-issue
        at once every group in flight since before ``before`` (Unix s; default now). Serialised; a second
        notice of the same restart re-issues nothing (``Registry.reissue_in_flight``). Returns the number
        re-issued.

        Raises:
            aiokafka.errors.KafkaError: the topics cannot be created (the broker is not back yet).
        """
        before = time.time() if before is None else before
        async with self._restart_lock:
            pools = {t for t in self._topics if t != topics.ROLLOUT_REQUESTS}
            await ensure_topics(self.cfg.kafka, [*topics.ALL, *sorted(pools), MARKER_TOPIC])
            self._marker_seen = True
            b = self.cfg.budget
            groups = self.registry.reissue_in_flight(before, self.cfg.scheduler.group_deadline_s,
                                                     recent_complete=(b.max_staleness + 1) * math.ceil(
                                                         b.batch_groups * b.oversample))
            self.broker_restarts += 1  # the consumer loops start over on the new broker
            log.warning("broker restart (%s): topics re-created, re-issuing %d in-flight groups now", why or "notice",
                        len(groups))
            await self._send(groups)
            return len(groups)

    async def _broker_loop(self) -> None:
        """Every :data:`BROKER_CHECK_INTERVAL_S`: has :data:`MARKER_TOPIC` vanished? Then the broker lost its
        topics (or restarted while this process was down, with groups in flight): :meth:`broker_restarted`.
        The first check, with the topics there, sends again the groups this process's predecessor left in flight
        unanswered (``Registry.resend_unanswered``: a kill -9 between writing a group and producing it)."""
        resent = False
        while not self._stop.is_set():
            admin = None
            try:
                admin = make_admin(self.cfg.kafka)
                await admin.start()
                names = set(await admin.list_topics())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the broker is down: the next check tells
                log.debug("broker check failed: %r", e)
                await self._sleep(1.0)
                continue
            finally:
                if admin is not None:
                    await admin.close()
            if MARKER_TOPIC not in names:
                if self._marker_seen:
                    await self.broker_restarted(why=f"the marker topic {MARKER_TOPIC} is gone")
                elif self.registry.in_flight_count(before=self._started_at):  # lost while this process was down
                    await self.broker_restarted(self._started_at, why=f"no marker topic {MARKER_TOPIC} at start "
                                                                      "and groups in flight from before")
                else:  # a fresh broker and nothing in flight: only mark it
                    await ensure_topics(self.cfg.kafka, [MARKER_TOPIC])
                    self._marker_seen = True
            else:
                self._marker_seen = True
            if not resent:  # the first check: the broker kept its topics, this process restarted
                resent = True
                groups = self.registry.resend_unanswered(self._started_at, self.cfg.scheduler.group_deadline_s)
                if groups:
                    log.warning("restarted with %d unanswered groups in flight (perhaps never sent): sending them "
                                "again", len(groups))
                    await self._send(groups)
            await self._sleep(BROKER_CHECK_INTERVAL_S)

    # ------------------------------------------------------------ consuming

    async def _consume(self, consumer: AIOKafkaConsumer, handle, commit: bool, on_start=None) -> None:
        """Run ``consumer`` until stopped, or until a broker restart is handled (:attr:`broker_restarts` moves:
        the caller's :meth:`_restarting` then builds a new consumer, from the committed or earliest offsets).
        ``handle`` takes each polled batch as one list of records (in partition order); when it raises, the
        batch is read again."""
        epoch = self.broker_restarts
        try:
            await asyncio.wait_for(consumer.start(), CONSUMER_START_TIMEOUT_S)
        except BaseException:
            await self._close(consumer)
            raise
        try:
            if on_start is not None:
                await on_start(consumer)
            wait_ms = int(min(self.cfg.scheduler.poll_interval_s, 0.2) * 1000) + 50
            while not self._stop.is_set() and epoch == self.broker_restarts:
                try:  # bounded: after a broker restart aiokafka can wait for a partition assignment forever
                    batch = await asyncio.wait_for(consumer.getmany(timeout_ms=wait_ms, max_records=500),
                                                   wait_ms / 1000 + GETMANY_SLACK_S)
                except asyncio.TimeoutError:
                    continue
                if not batch:
                    continue
                try:
                    await handle([msg for msgs in batch.values() for msg in msgs])
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("handling a batch failed; re-reading it")
                    for tp, msgs in batch.items():
                        consumer.seek(tp, msgs[0].offset)
                    await self._sleep(1.0)
                    continue
                if commit:
                    await commit_batch(consumer, batch)
                self.wake()
        finally:
            await self._close(consumer)

    @staticmethod
    async def _close(consumer: AIOKafkaConsumer) -> None:
        """Stop ``consumer`` within :data:`CONSUMER_STOP_TIMEOUT_S` (a group consumer whose coordinator died can
        otherwise wait on it much longer)."""
        stopping = asyncio.ensure_future(consumer.stop())  # not wait_for: it would wait out a stop that ignores
        done, _ = await asyncio.wait([stopping], timeout=CONSUMER_STOP_TIMEOUT_S)  # the cancellation
        if not done:
            log.warning("a consumer did not stop within %.0f s; left behind", CONSUMER_STOP_TIMEOUT_S)

    async def _rewards_loop(self) -> None:
        consumer = make_consumer(self.cfg.kafka, topics.REWARDS, topics.GROUP_DROPS,
                                 group_id=self.cfg.scheduler.consumer_group, client_id="scheduler-rewards")
        await self._consume(consumer, self._on_outcomes, commit=True)

    async def _on_outcomes(self, msgs: list) -> None:
        """One polled batch of flywheel.rewards and flywheel.group_drops records, in order: each run of
        consecutive rewards is recorded in one registry transaction (:meth:`Registry.record_rewards`)."""
        rewards: list = []
        for msg in msgs:
            if msg.topic == topics.GROUP_DROPS:
                await self._on_rewards(rewards)
                rewards = []
                await self._on_drop(msg)
            else:
                rewards.append(msg)
        await self._on_rewards(rewards)

    async def _decode(self, msg, cls):
        """Decode ``msg`` as ``cls``; a malformed record is dead-lettered, counted, and ``None`` returned."""
        rec = await decode_or_dead_letter(self.producer, msg, cls, self.name)
        if rec is None:
            self.metrics.dlq.labels(msg.topic).inc()
        return rec

    async def _on_drop(self, msg) -> None:
        ev = await self._decode(msg, GroupDropped)
        if ev is None:
            return
        self.metrics.group_drops.labels(ev.reason).inc()
        freed = self.registry.record_drop(ev.group_id, ev.reason)
        if freed is not None:
            log.warning("trainer dropped group %s (%s, behaviour version %s at policy version %d): its slot is "
                        "given back and a new group will be issued", ev.group_id, ev.reason, ev.behaviour_version,
                        ev.policy_version)

    async def _on_rewards(self, msgs: list) -> None:
        """Decode flywheel.rewards records (malformed ones dead-lettered), record them in one registry
        transaction, then act on each outcome in order (pauses, the drift guard, stats, metrics, logs)."""
        events = [ev for ev in [await self._decode(m, RewardEvent) for m in msgs] if ev is not None]
        if not events:
            return
        budget, version = self.cfg.budget, self.registry.policy_version
        # no re-samples once the trainer is done: nothing would train them
        resample_n = budget.resample_unsolved if version < budget.max_steps else 0
        for ev, outcome in zip(events, self.registry.record_rewards(events, resample_n)):
            await self._after_reward(ev, outcome, version)

    async def _after_reward(self, ev: RewardEvent, outcome: RewardOutcome, version: int) -> None:
        # only events of this registry's groups (another deployment's tasks are not ours to pause)
        if ev.misconfigured and outcome.new and self.registry.pause_domain(ev.domain, ev.reason or "misconfigured",
                                                                           ev.task_id):
            log.error("ALERT domain %r paused: the verifier reports its spec is broken (task %s: %s); fix the tasks, "
                      "then POST /v1/domains/%s/resume", ev.domain, ev.task_id, ev.reason, ev.domain)
            await self.guard.announce(ev.domain)
        if outcome.counted:
            await self.guard.on_reward(ev, selected=outcome.selected, level=outcome.level)
        self.stats.on_reward(ev, outcome, version)
        self.metrics.reward(ev, outcome, version)
        if outcome.completed:
            log.debug("group %s complete", ev.group_id)  # per group: thousands a second in the null pipeline
        for note in outcome.notes:
            log.info("%s", note)
        if outcome.resample is not None:  # written pending: the issue loop sends it on its next pass
            log.info("group %s unsolved: re-sampling task %s with %d samples as %s", ev.group_id, ev.task_id,
                     outcome.resample.n, outcome.resample.group_id)

    async def _watch_loop(self) -> None:
        consumer = make_consumer(self.cfg.kafka, topics.WEIGHTS, topics.METRICS, group_id=None,
                                 client_id="scheduler-watch")
        await self._consume(consumer, _each(self._on_watch), commit=False)

    async def _on_watch(self, msg) -> None:
        if msg.topic == topics.WEIGHTS:
            wu = await self._decode(msg, WeightUpdate)
            want = self.cfg.scheduler.weights_model or self.cfg.model.name
            if wu is None or wu.model != want:
                return
            if self.registry.raise_policy_version(wu.version):
                log.info("policy version %d (step %d)", wu.version, wu.step)
        else:
            m = await self._decode(msg, Metrics)
            if m is not None:
                self.stats.on_metrics(m)
                await self.guard.on_metrics(m)

    async def _control_loop(self) -> None:
        # a new deployment starts at the end: commands sent to an earlier run on this broker are not ours
        consumer = make_consumer(self.cfg.kafka, topics.CONTROL, group_id=f"{self.cfg.scheduler.consumer_group}-control",
                                 client_id="scheduler-control", offset_reset="latest")
        await self._consume(consumer, _each(self.guard.on_control), commit=True, on_start=self._control_positioned)

    async def _control_positioned(self, consumer: AIOKafkaConsumer) -> None:
        """Wait for the control consumer's partitions and resolve its start offsets, then set
        ``guard.control_ready`` (records sent after that are applied)."""
        while not consumer.assignment() and not self._stop.is_set():
            batch = await consumer.getmany(timeout_ms=100, max_records=1)  # joins the group
            for msgs in batch.values():
                for msg in msgs:
                    await self.guard.on_control(msg)
        for tp in consumer.assignment():
            await consumer.position(tp)
        self.guard.control_ready.set()


def _each(handle):
    """A batch handler for :meth:`Sampler._consume` that awaits ``handle(record)`` for each record in order."""
    async def handle_batch(msgs: list) -> None:
        for msg in msgs:
            await handle(msg)
    return handle_batch
