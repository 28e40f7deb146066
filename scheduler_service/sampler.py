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

The sampler watches the broker like the other services (a :class:`shared.kafka.BrokerWatch`, one per
process): every offset commit and every awaited send (requests, control and alert records, reports, tasks)
goes through ``watch.guard``, so with the broker gone it gives up at once (a request goes back to ``pending``,
a best-effort record is logged as not sent) instead of waiting ``kafka.request_timeout_ms`` or, for a commit,
until the broker is back. A consumer loop that lost the broker (:class:`shared.kafka.BrokerLost` or one of
:data:`shared.kafka.BROKER_ERRORS`) waits for it, looks for the marker topic once (an empty broker: the
topics are re-created and in-flight groups re-issued before any consumer is rebuilt), and starts over with a
new consumer from the committed offsets.

The issue loop is :class:`scheduler_service.issue_loop.IssueLoop`, the consumer loops
:class:`scheduler_service.consumer_loops.ConsumerLoops`; this module runs them and handles broker restarts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

from aiokafka import AIOKafkaProducer

from scheduler_service.config import SchedulerSettings
from scheduler_service.consumer_loops import ConsumerLoops
from scheduler_service.guard import DriftGuard
from scheduler_service.issue_loop import IssueLoop
from scheduler_service.issuing import IssuePlanner, TaskMaker
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.registry import Registry
from scheduler_service.reports import Reporter
from scheduler_service.stall import StallWatch
from scheduler_service.stats import Stats
from shared import topics
from shared.kafka import BROKER_ERRORS, BrokerLost, BrokerWatch, ensure_topics, make_admin, reconnect_pause

log = logging.getLogger(__name__)

MARKER_TOPIC = "flywheel.scheduler.marker"
"""A topic only the scheduler creates and nobody produces to: its absence means the broker lost its topics."""
BROKER_CHECK_INTERVAL_S = 5.0
"""Seconds between the sampler's checks for :data:`MARKER_TOPIC` (one metadata request each)."""


class Sampler(IssueLoop, ConsumerLoops):
    """Flow control and bookkeeping of rollout groups for one scheduler process.

    Args:
        config: the scheduler's settings.
        registry: the opened task registry.
        producer: a started Kafka producer (requests, dead letters).
        stats: the process's ``GET /v1/status`` statistics, fed with every reward and metrics record.
        metrics: the process's Prometheus families (``GET /metrics``); ``None``: a private set.
        watch: the process's broker watch (started by :meth:`start`, closed by its owner); ``None``: one of the
            sampler's own, closed by :meth:`stop`.
    """

    def __init__(self, config: SchedulerSettings, registry: Registry, producer: AIOKafkaProducer,
                 stats: Stats, metrics: SchedulerMetrics | None = None, watch: BrokerWatch | None = None) -> None:
        self.cfg = config
        self.registry = registry
        self.producer = producer
        self.stats = stats
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self._own_watch = watch is None
        self.watch = watch if watch is not None else BrokerWatch(config.kafka, "scheduler")
        """Whether the broker answers; every commit and awaited send goes through its :meth:`BrokerWatch.guard`."""
        self.rng = random.Random(self.cfg.scheduler.seed)
        self.planner = IssuePlanner(config, registry)
        self.maker = TaskMaker(config, registry)
        self.guard = DriftGuard(config, registry, producer, self.planner.blocked, metrics=self.metrics,
                                watch=self.watch)
        self.stall = StallWatch(config.scheduler.stall_after_s)
        """Whether the run can go on (``run/stalled``)."""
        self.reports = Reporter(registry, stats, producer, config.scheduler.metrics_interval_s,
                                lambda: {d: b.state for d, b in self.guard.monitor.breakers.items()},
                                lambda: len(self.guard.monitor.active), watch=self.watch)
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # set by whatever may give the issue loop work: a record handled, a REST change
        self._task: asyncio.Task | None = None
        self._making: asyncio.Task | None = None
        self._starved_at = 0.0
        self._topics: set[str] = {topics.ROLLOUT_REQUESTS}
        self.name = "scheduler"
        self._restart_lock = asyncio.Lock()
        self._look_lock = asyncio.Lock()
        self._looked_epoch = 0  # the watch's epoch when the marker was last looked for after an outage
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
        self.watch.start()
        self._task = asyncio.create_task(self._run(), name="scheduler-sampler")

    async def _first_tasks(self) -> None:
        """Make the generator domains' first tasks before the first issue decision, so the pre-training
        eval round holds their held-out sets and no domain starts starved."""
        first = {d: r.config.level for d, r in self.registry.domain_rows().items() if r.config.makes_tasks}
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
        try:
            if self._task is None:
                return
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except asyncio.TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        finally:
            if self._own_watch:
                await self.watch.close()

    async def _run(self) -> None:
        if not await self.watch.wait_up(self._stop):  # the start announcements need the broker
            return
        await self.guard.announce_all()
        await self._first_tasks()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._issue_loop())
            tg.create_task(self._restarting(self._rewards_loop))
            tg.create_task(self._restarting(self._watch_loop))
            tg.create_task(self._restarting(self._control_loop))
            tg.create_task(self._restarting(self._broker_loop))

    async def _restarting(self, loop) -> None:
        """Run a consumer loop until stopped, restarting it after a failure and after a broker restart is
        handled: then the running loop is cancelled wherever it waits (a fetch waiting for an assignment, an ack
        from the old broker) and started again with a new consumer. A loop that lost the broker
        (:class:`shared.kafka.BrokerLost`, :data:`shared.kafka.BROKER_ERRORS`) is started again once the broker
        answers, after :meth:`_after_outage` and a back-off (``kafka.reconnect_backoff_ms``, doubling while the
        broker answers and the loop still fails)."""
        attempt = 0
        while not self._stop.is_set():
            if not await self.watch.wait_up(self._stop):
                return
            try:
                await self._after_outage()
            except asyncio.CancelledError:
                raise
            except (BrokerLost, *BROKER_ERRORS) as e:
                log.warning("%s: broker unreachable, retrying (%r)", loop.__name__, e)
                await reconnect_pause(self.cfg.kafka, attempt, self._stop)
                attempt += 1
                continue
            except Exception:
                log.exception("%s: handling the broker's return failed; retrying in 1 s", loop.__name__)
                await self._sleep(1.0)
                continue
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
            except (BrokerLost, *BROKER_ERRORS) as e:
                log.warning("%s: broker unreachable, retrying (%r); a new consumer from the committed offsets once "
                            "it is back", loop.__name__, e)
                await reconnect_pause(self.cfg.kafka, attempt, self._stop)
                attempt = attempt + 1 if self.watch.up else 0
            except Exception:
                log.exception("%s failed; restarting in 1 s", loop.__name__)
                await self._sleep(1.0)
            else:
                attempt = 0
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
            if not self.watch.up:  # no use asking a broker that is gone
                await self.watch.wait_up(self._stop)
                continue
            try:
                names = await self._topic_names()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the broker is down: the next check tells
                log.debug("broker check failed: %r", e)
                await self._sleep(1.0)
                continue
            async with self._look_lock:
                await self._on_topics(names)
            if not resent:  # the first check: the broker kept its topics, this process restarted
                resent = True
                groups = self.registry.resend_unanswered(self._started_at, self.cfg.scheduler.group_deadline_s)
                if groups:
                    log.warning("restarted with %d unanswered groups in flight (perhaps never sent): sending them "
                                "again", len(groups))
                    await self._send(groups)
            await self._sleep(BROKER_CHECK_INTERVAL_S)

    async def _topic_names(self) -> set[str]:
        """The broker's topic names (one metadata request).

        Raises:
            aiokafka.errors.KafkaError: the broker did not answer.
        """
        admin = make_admin(self.cfg.kafka)
        try:
            await admin.start()
            return set(await admin.list_topics())
        finally:
            await admin.close()

    async def _on_topics(self, names: set[str]) -> None:
        """Act on the broker's topic names: :data:`MARKER_TOPIC` gone, the broker lost its topics
        (:meth:`broker_restarted`); never seen and nothing in flight, a fresh broker: only create it. Called under
        ``_look_lock``."""
        if MARKER_TOPIC in names:
            self._marker_seen = True
        elif self._marker_seen:
            await self.broker_restarted(why=f"the marker topic {MARKER_TOPIC} is gone")
        elif self.registry.in_flight_count(before=self._started_at):  # lost while this process was down
            await self.broker_restarted(self._started_at, why=f"no marker topic {MARKER_TOPIC} at start "
                                                              "and groups in flight from before")
        else:  # a fresh broker and nothing in flight: only mark it
            await ensure_topics(self.cfg.kafka, [MARKER_TOPIC])
            self._marker_seen = True

    async def _after_outage(self) -> None:
        """Once per return of the broker (the watch's :attr:`BrokerWatch.epoch`), before a consumer loop builds its
        new consumer: look for :data:`MARKER_TOPIC` now, so that an empty broker gets its topics back and the
        in-flight groups re-issued first (:attr:`broker_restarts` moves before the loops read it, and they are not
        rebuilt twice).

        Raises:
            aiokafka.errors.KafkaError: the broker did not answer (the caller retries).
        """
        async with self._look_lock:
            epoch = self.watch.epoch
            if epoch == self._looked_epoch:
                return
            await self._on_topics(await self._topic_names())
            self._looked_epoch = epoch
