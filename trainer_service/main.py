"""Trainer service: consume scored trajectories, step on complete groups, publish weight versions.

Loop: ``getmany`` → buffer records into groups → fold what flywheel.control has fetched, without
waiting (:mod:`trainer_service.control`) → (drop stale; drop the ready groups of the domains it blocks,
``circuit_open`` or ``domain_paused``) → announce every group dropped (stale, failed, superseded,
blocked) on flywheel.group_drops and wait for the acks, so the scheduler gives its slot back → unless
``pause_training`` is in force (then no step: records are still buffered and what is safe committed),
when ``budget.batch_groups`` groups are ready, one optimizer step in a worker thread →
snapshot weights and state → (in the background, in version order: :class:`Publisher`) write the
version's weights, announce it on flywheel.weights, write the trainer state, send the step's metrics
on flywheel.metrics, and only then release the trained groups' offsets → commit, per partition, the
oldest offset not yet trained-and-durable or dropped. One pass of this loop is :meth:`TrainLoop.turn`.
Before the first pass the trainer reads flywheel.control to its end, so a restart obeys what was sent.

Writing a checkpoint overlaps the next optimizer step. A version is announced as soon as its
weights are durable (~1 s for SmolLM2 here), before the optimizer state (~1.5 s more): rollout
engines wait on the announcement, so it is on the critical path of every step. A crash never
leaves a rollout engine holding weights the restarted trainer does not have: the trainer resumes
at the newest published version (:func:`build_trainer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch
from aiokafka import TopicPartition

from shared import kafka, topics
from shared.checkpoint import CheckpointStore, DiskFullError, DiskLevel, DiskPolicy, checkpoint_bytes
from shared.metrics import serve_metrics
from shared.model import load_model, load_tokenizer, resolve_model_dir
from shared.schemas import AdapterInfo, Alert, GroupDropped, Metrics, ScoredTrajectory, WeightUpdate
from shared.telemetry import flush_tracing
from shared.threads import CoreBurst
from shared.threads import attach as attach_burst
from trainer_service.config import TrainerSettings
from trainer_service.control import ControlState, poll_control, read_control_to_end
from trainer_service.domain_metrics import domain_metrics
from trainer_service.groups import Drop, Group, GroupBuffer
from trainer_service.canary import CanaryCheck
from trainer_service.metrics import TrainerMetrics
from trainer_service.null_step import NULL_CHECKSUM, NULL_LEDGER, NullTrainer
from trainer_service.tracing import GroupTraces
from trainer_service.trainer import PolicyTrainer

log = logging.getLogger("trainer")
DRAIN_TIMEOUT_S = 120.0
"""Seconds a graceful stop waits for the version being published (:meth:`TrainLoop.drain`)."""


def build_trainer(config: TrainerSettings) -> tuple[PolicyTrainer, CheckpointStore, set[str]]:
    """Model, optimizer and checkpoint store, resumed at the newest published version when there is one.

    Normally that version is complete and the resume is exact. If the trainer died after publishing
    a version's weights but before writing its trainer state (a window of about a second), it resumes
    at that version with the previous version's optimizer state and RNG (logged as a warning), and
    with the ids of the groups that version trained, so none is trained twice.

    Raises:
        RuntimeError: the complete version has no trainer state file.
    """
    cfg = config.trainer
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model_dir(config.model.name, config.model.cache_dir)
    tok = load_tokenizer(model_dir)
    trainer = PolicyTrainer(load_model(model_dir, cfg.dtype, cfg.attention), cfg, tok.pad_token_id,
                            config.budget.max_steps)
    trainer.canary = CanaryCheck(trainer.model, tok)  # is each engine serving what was published?
    burst = CoreBurst(cfg.torch_threads, cfg.burst_threads)
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            attach_burst(model, burst)
    store = CheckpointStore(config.run.path(config.run.checkpoint_dir), cfg.keep_checkpoints)
    for p in store.remove_partial():  # a write interrupted by a crash or a full disk
        log.warning("removed the partial checkpoint file %s", p)
    done: set[str] = set()
    complete, published = store.latest(), store.newest_published()
    if complete is not None:
        state = store.load_trainer_state(complete.version)
        if state is None:
            raise RuntimeError(f"checkpoint v{complete.version} has weights but no trainer state")
        done = trainer.load_state_dict(state)
        if not trainer.optimizer_restored and trainer.version < config.budget.max_steps:
            raise RuntimeError(f"checkpoint v{complete.version} has no optimizer state (dropped when its run finished: "
                               "trainer.drop_optimizer_on_finish or flywheel clean), so training cannot go on from it "
                               f"exactly to budget.max_steps={config.budget.max_steps}; start a new run directory")
    if published is not None:
        trainer.load_published(published)
        if complete is None or published.version != complete.version:
            log.warning("policy version %d was published without its trainer state: resuming at it with the "
                        "optimizer state of version %s", published.version,
                        complete.version if complete else "0 (fresh)")
            trainer.step, trainer.version = published.step, published.version
            done |= store.trained_groups(published.version)
        log.info("resumed at policy version %d (step %d, %d groups done)", trainer.version, trainer.step, len(done))
    trainer.canary.record(trainer.version)
    return trainer, store, done


async def run(config: TrainerSettings, stop: asyncio.Event | None = None) -> None:
    """Run the trainer until ``stop`` is set (SIGTERM/SIGINT set it when ``stop`` is None); Prometheus
    metrics (:mod:`trainer_service.metrics`) are served on ``telemetry.metrics_port`` when it is set.

    A broker outage never ends the trainer: a :class:`shared.kafka.BrokerWatch` notices the broker go away,
    nothing more is committed on the old clients, and once the broker answers the Kafka clients are rebuilt
    (:func:`_session`: topics re-created, the newest published version re-announced, flywheel.control read
    to its end, the group re-joined) while the model, the optimizer and the ids of the groups already
    trained stay in memory. A step being published meanwhile waits for the new producer (:meth:`Publisher._announce`).

    Raises:
        RuntimeError: the checkpoint store is inconsistent (:func:`build_trainer`).
    """
    stop, _ = kafka.prepare_service("trainer", config, stop)
    if config.trainer.null_step:  # benchmark mode: no model, no checkpoints (trainer_service/null_step.py)
        store = CheckpointStore(config.run.path(config.run.checkpoint_dir), config.trainer.keep_checkpoints)
        trainer, done = NullTrainer(store.root / NULL_LEDGER), set()
        log.warning("trainer.null_step: no model is loaded and every optimizer step is a no-op (a benchmark)")
    else:
        trainer, store, done = await asyncio.to_thread(build_trainer, config)
    buffer = GroupBuffer(config.budget.max_staleness, done, config.budget.resample_unsolved)
    prom = TrainerMetrics()
    prom.watch_version(lambda: trainer.version)
    publisher = Publisher(config, store, buffer, None, await _broadcaster(config), prom)
    control = ControlState()
    metrics_server = serve_metrics(config.telemetry, prom.registry)
    watch = kafka.BrokerWatch(config.kafka, "trainer")
    held: dict[str, TrainLoop] = {}  # the TrainLoop, kept across sessions (a broken session raises, never returns)
    try:
        attempt = 0
        while not stop.is_set():
            if not await watch.wait_up(stop):
                break
            try:
                await _session(config, watch, trainer, buffer, publisher, control, held, stop)
                break  # stopped
            except (kafka.BrokerLost, *kafka.BROKER_ERRORS) as e:
                log.warning("broker unreachable, retrying (%r): nothing more is committed until the clients are "
                            "rebuilt", e)
                await kafka.reconnect_pause(config.kafka, attempt, stop)
                attempt = attempt + 1 if watch.up else 0
        loop = held.get("loop")
        if loop is not None and loop.publishing is not None:
            # stopped between two sessions (a broker outage: the supervisor's death takes the broker down with
            # the services): no client is left to announce on; write the version whole, the next start
            # announces it. A publication that failed meanwhile raises its error here.
            publisher.abandon()
            try:
                await loop.drain()
            except asyncio.TimeoutError as e:
                log.warning("stopped without the version being published: %s", e)
    except asyncio.CancelledError:
        raise
    finally:
        await watch.close()
        flush_tracing()
        if metrics_server is not None:
            metrics_server.close()
        log.info("trainer stopped at policy version %d", trainer.version)


async def _session(config: TrainerSettings, watch: kafka.BrokerWatch, trainer: PolicyTrainer, buffer: GroupBuffer,
                   publisher: "Publisher", control: ControlState, held: "dict[str, TrainLoop]",
                   stop: asyncio.Event) -> "TrainLoop":
    """The trainer's loop on one set of Kafka clients until ``stop``; then the step being published is
    finished (:meth:`TrainLoop.drain`) and the loop returned. The clients are closed when this returns or
    raises.

    ``held`` keeps the :class:`TrainLoop` under ``"loop"`` from the moment it is made, so the next session finds
    it even though a lost broker ends this one by raising (before, a rebuilt session never forgot the old
    broker's offsets and could commit past records it had not read).
    On a rebuild (``held["loop"]`` set) the step being published is first finished on the new producer, then what
    the buffer held from the lost clients is forgotten (:func:`_forget_positions`): its offsets belong to the
    old session, and the consumer starts again from the committed offsets (an empty broker: from the
    earliest), as after a process restart.

    Raises:
        shared.kafka.BrokerLost: the broker went away (checked every turn and before every commit).
        aiokafka.errors.KafkaError: a broker error (:data:`shared.kafka.BROKER_ERRORS`).
    """
    epoch = watch.epoch
    loop = held.get("loop")
    producer = consumer = control_consumer = None
    try:
        await kafka.ensure_topics(config.kafka)
        producer = kafka.make_producer(config.kafka, "trainer")
        consumer = kafka.make_consumer(config.kafka, topics.SCORED, group_id="trainer", client_id="trainer")
        # no group, from the earliest offset: every start folds the whole topic
        control_consumer = kafka.make_consumer(config.kafka, topics.CONTROL, group_id=None,
                                               client_id="trainer-control")
        await producer.start()
        publisher.producer = producer
        latest = publisher.store.newest_published()
        if latest is not None:  # re-announce: the broker may have lost the record (or it was never sent)
            await watch.guard(_send_and_wait(producer, topics.WEIGHTS, latest, latest.model), epoch)
        if loop is not None and loop.publishing is not None and not loop.publishing.done():
            await watch.guard(asyncio.shield(loop.publishing), epoch)
        if loop is not None:
            _forget_positions(buffer)
        await consumer.start()
        await control_consumer.start()
        await read_control_to_end(control_consumer, producer, control)
        if loop is None:
            loop = held["loop"] = TrainLoop(config, trainer, buffer, consumer, producer, publisher, control_consumer,
                                            control)
        else:
            loop.consumer, loop.producer, loop.control_consumer = consumer, producer, control_consumer
            log.info("trainer resumed on the broker at policy version %d", trainer.version)
        loop.commit_guard = lambda commit: watch.guard(commit, epoch)
        while not stop.is_set():
            watch.check(epoch)
            await loop.turn()
        if loop.publishing is not None:
            await loop.drain(watch.down_for)  # graceful stop: finish announcing what was trained, on these clients
            loop.publishing = None
        return loop
    finally:
        publisher.producer = None
        await kafka.stop_clients(consumer, control_consumer, producer)


async def _send_and_wait(producer, topic: str, record, key: str) -> None:
    await (await kafka.send(producer, topic, record, key))


def _forget_positions(buffer: GroupBuffer) -> None:
    """Forget the partial and ready groups and the read and commit positions the buffer holds from the
    previous Kafka clients (what a restarted trainer would not have either); keep the ids of the groups
    trained or dropped (so none is trained twice) and the drops not yet announced. Their records are
    redelivered from the committed offsets, or, when an empty broker lost them, re-issued by the scheduler.

    (``GroupBuffer`` keeps no method for it; the attributes used are ``partial``, ``ready``, ``_pending`` and
    ``_next`` of :class:`trainer_service.groups.GroupBuffer`.)
    """
    forgotten = len(buffer.partial) + len(buffer.ready)
    buffer.partial.clear()
    buffer.ready.clear()
    buffer._pending.clear()
    buffer._next.clear()
    if forgotten:
        log.warning("broker session rebuilt: %d partial or ready groups forgotten (redelivered or re-issued)",
                    forgotten)


async def _broadcaster(config: TrainerSettings):
    """The torch.distributed weight broadcaster (``weights.transport: distributed``), else ``None``."""
    if config.weights.transport != "distributed":
        return None
    from shared.weight_sync import WeightBroadcaster

    w = config.weights
    broadcaster = await asyncio.to_thread(WeightBroadcaster, w.broadcast_host, w.broadcast_port, w.broadcast_backend,
                                          w.broadcast_timeout_s)
    log.info("weight broadcast store on %s:%d", w.broadcast_host, w.broadcast_port)
    return broadcaster


class TrainLoop:
    """One pass of the trainer's loop per :meth:`turn`: take records, drop and announce, step, commit.

    Args:
        config: the trainer's settings.
        trainer: the model and optimizer.
        buffer: the group buffer (resumed with the groups already trained).
        consumer: a started consumer of flywheel.scored (manual commits).
        producer: a started producer (drops, dead letters).
        publisher: makes each step durable and announces it, in version order.
        control_consumer: a started consumer of flywheel.control (no group), polled without waiting each
            turn; ``None``: nothing is polled (``control`` stays as given).
        control: the fold of flywheel.control so far (:func:`trainer_service.control.read_control_to_end`);
            ``None``: a fresh :class:`ControlState` (nothing blocked, not paused).
    """

    def __init__(self, config: TrainerSettings, trainer: PolicyTrainer, buffer: GroupBuffer, consumer,
                 producer, publisher: "Publisher", control_consumer=None, control: ControlState | None = None) -> None:
        self.config, self.trainer, self.buffer = config, trainer, buffer
        self.consumer, self.producer, self.publisher = consumer, producer, publisher
        self.metrics = publisher.metrics  # Prometheus: drops and dead letters here, steps in the publisher
        self.control_consumer = control_consumer
        self.control = control if control is not None else ControlState()
        self.publishing: asyncio.Task | None = None
        self.last_step_end = self.last_report = time.perf_counter()
        self.pause_logged = False  # the current pause has been reported
        self.traces = GroupTraces()  # each group's trace ends in a train_group span (trained or dropped)
        self.canary: CanaryCheck | None = getattr(trainer, "canary", None)
        self.canary_alerted = False  # a run/canary alert is firing
        self.commit_guard: Callable[[Awaitable], Awaitable] | None = None
        """Wraps every commit (the session's :meth:`shared.kafka.BrokerWatch.guard`): raises
        ``shared.kafka.BrokerLost`` when the broker went away since the clients were made, or goes away while the
        commit waits. Offsets of a lost broker are never committed on its successor, and a commit under way when
        the broker dies does not hold the session: aiokafka's commit waits for a group coordinator until a
        broker answers again (a stop meanwhile could not drain)."""

    async def turn(self) -> None:
        """Intake (≤ 200 ms long-poll), control (no wait), drops, at most one step (none while training
        is paused), then commit what is durable.

        Control is folded after the intake and before the drops and :meth:`GroupBuffer.take`, so a group
        of a domain blocked by a record fetched before this point is never trained.
        """
        budget, buffer, control = self.config.budget, self.buffer, self.control
        await self._intake()
        if self.control_consumer is not None:
            await poll_control(self.control_consumer, self.producer, control)
        training = self.trainer.version < budget.max_steps
        if training:
            buffer.drop_stale(self.trainer.version)
            buffer.drop_blocked(control.blocked, control.drop_groups)
            if self.canary is not None and buffer.ready:
                buffer.drop_unless(self._canary_ok, "dropped_canary")
                await self._canary_alert()
        if buffer.has_drops:
            announced = await _announce_drops(self.producer, buffer, self.trainer.version)
            self.traces.dropped(announced, self.trainer.step, self.trainer.version)
            self.metrics.dropped(announced)
        if not control.training_paused:
            self.pause_logged = False
        if training:
            if control.training_paused:
                self._report_pause()
            elif len(buffer.ready) >= budget.batch_groups and not self.publisher.disk_blocked:
                await self._step()
            else:
                self._report_stall()
        if self.publishing is not None and self.publishing.done():
            self.publishing.result()  # surface a failed save or send
        await self._commit()

    async def drain(self, broker_down_s: Callable[[], float | None] = lambda: None,
                    timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """At a graceful stop: wait for the version being published, then commit.

        Once the broker has been away for ``trainer.drain_broker_wait_s`` (``broker_down_s()``: seconds it has
        been unreachable, ``None`` while it answers; :meth:`shared.kafka.BrokerWatch.down_for`), the
        publisher abandons the announcements it waits on (:meth:`Publisher.abandon`): the version's files are
        still all written (within ``timeout_s``), so a restarted trainer resumes at it exactly and announces
        its weights then (the step's metrics records are not sent); no offset is committed (the trained
        groups' ids are in the trainer state). At ``timeout_s`` seconds the publication is cancelled.

        Raises:
            asyncio.TimeoutError: ``timeout_s`` passed; the publication was cancelled (a write thread that
                still runs keeps the update gate shut until it returns: :meth:`StepSnapshot.in_thread`).
            Whatever the publication raised (a failed write).
        """
        if self.publishing is None:
            return
        publishing, grace = self.publishing, self.config.trainer.drain_broker_wait_s
        deadline = time.monotonic() + timeout_s
        try:
            while not publishing.done():
                now, down = time.monotonic(), broker_down_s()
                if now >= deadline:
                    log.warning("stopping before the version being published was written and announced: it took "
                                "over %.0f s", timeout_s)
                    publishing.cancel()
                    await asyncio.wait({publishing})
                    if publishing.cancelled():
                        raise asyncio.TimeoutError(f"the publication took over {timeout_s:.0f} s")
                    break  # it ended meanwhile: its result or its error below
                if down is not None and down >= grace and not self.publisher.abandoned:
                    log.warning("stopping with the broker away for %.0f s: the version being published is written "
                                "without its announcements (a restarted trainer announces it)", down)
                    self.publisher.abandon()
                await asyncio.wait({publishing}, timeout=min(0.5, deadline - now))
        except asyncio.CancelledError:
            publishing.cancel()
            raise
        if publishing.cancelled():  # by an earlier drain's bound: nothing more to wait for, nothing to commit
            return
        publishing.result()
        if not self.publisher.abandoned:
            await self._commit()

    async def _intake(self) -> None:
        batch = await self.consumer.getmany(timeout_ms=200, max_records=1024)
        for tp, msgs in batch.items():
            for msg in msgs:
                scored = await kafka.decode_or_dead_letter(self.producer, msg, ScoredTrajectory, "trainer")
                if scored is None:
                    self.metrics.dlq.labels(tp.topic).inc()
                self.traces.remember(scored, msg.headers, self.buffer)
                self.buffer.add(scored, (tp.topic, tp.partition), msg.offset)

    async def _commit(self) -> None:
        """Commit per partition the oldest offset not yet trained-and-durable; never while a drop is
        unacknowledged (its records must come back after a crash)."""
        offsets = {TopicPartition(t, p): o for (t, p), o in self.buffer.commit_offsets().items()}
        if offsets and not self.buffer.has_drops:
            commit = self.consumer.commit(offsets)
            await (commit if self.commit_guard is None else self.commit_guard(commit))

    def _report_pause(self) -> None:
        if not self.pause_logged:
            self.pause_logged = True
            log.warning("training paused (flywheel.control): no step at policy version %d, %d groups ready",
                        self.trainer.version, len(self.buffer.ready))
        self._report_stall()

    def _report_stall(self) -> None:
        now = time.perf_counter()
        if now - max(self.last_step_end, self.last_report) > self.config.trainer.stall_report_s:
            self.last_report = now
            paused = ", training paused by flywheel.control" if self.control.training_paused else ""
            log.warning("no step for %.0f s at policy version %d (assigned %s%s): %s", now - self.last_step_end,
                        self.trainer.version, sorted(self.consumer.assignment()), paused, self.buffer.describe())

    def _canary_ok(self, group: Group) -> bool:
        """The canary check of ``group``, made once (when it is first seen ready) and kept on the group."""
        if group.canary_ok is None:
            group.canary_ok = self.canary.check(group).ok
        return group.canary_ok

    async def _canary_alert(self) -> None:
        """Send a ``run/canary`` :class:`Alert` (critical, source ``trainer``) when an engine starts failing the
        canary check, and its ``resolved`` when none fails any more; logged either way. A failed send is logged
        only (the drops and the ``canary/*`` metrics remain)."""
        failing = self.canary.failing
        if bool(failing) == self.canary_alerted:
            return
        self.canary_alerted = bool(failing)
        worst = max(failing.values(), default=0.0)
        if failing:
            msg = (f"engines {sorted(failing)} scored the canary up to {worst:.3f} nats/token away from the "
                   f"published weights: their groups are not trained until they pass again")
            log.error(msg)
        else:
            msg = "every engine passes the canary check again"
            log.warning(msg)
        alert = Alert(source="trainer", signal="canary", status="firing" if failing else "resolved",
                      severity="critical", value=worst, window=0, window_unit="steps",
                      policy_version=self.trainer.version, message=msg[:4096],
                      details={"engines": sorted(failing)})
        try:
            await (await kafka.send(self.producer, topics.ALERTS, alert, alert.key))
        except Exception as e:  # noqa: BLE001 - the broker may be the trouble too; the log line stands
            log.warning("could not send the canary alert (%r)", e)

    async def _step(self) -> None:
        """Train one step now; its publication runs in the background after the previous one's."""
        trainer, buffer, budget = self.trainer, self.buffer, self.config.budget
        wait_s = time.perf_counter() - self.last_step_end
        # with oversampling (budget.oversample > 1) the scheduler issues more groups than a step takes:
        # pick those whose rewards differ first; the rest wait for the next step or go stale (counted)
        # a bounded step: re-samples of unsolved groups are 3x larger, so rows are capped (budget.max_step_samples)
        cap = budget.max_step_samples or 2 * budget.batch_groups * (buffer.smallest_group or 1)
        groups = buffer.take(budget.batch_groups, prefer_informative=budget.oversample > 1, max_samples=cap)
        start_ns = time.time_ns()
        metrics = await asyncio.to_thread(trainer.train_step, groups)
        if self.canary is not None:  # the new version's own scoring, before the next step changes the weights
            await asyncio.to_thread(self.canary.record, trainer.version)
            metrics.update(self.canary.take_metrics())
        self.traces.trained(groups, trainer.step, trainer.version, start_ns, time.time_ns())
        t0 = time.perf_counter()
        done = buffer.done_groups | buffer.in_flight  # includes earlier steps still being saved
        gate = None
        if self.config.trainer.null_step:
            weights, state = {}, {}
        else:
            try:
                # the live tensors, no copy (1.6 GB for SmolLM2: 0.2 s of the step): the next optimizer step waits
                # for the publisher to have written them (PolicyTrainer.update_gate, set by StepSnapshot.release)
                weights, state = trainer.published_weights(), trainer.state_dict(done, copy_optimizer=False)
                gate = trainer.update_gate
                gate.clear()
            except ValueError:  # a CUDA or non-contiguous model: CPU copies, and nothing to wait for
                weights, state = await asyncio.to_thread(lambda: (trainer.published_weights(live=False),
                                                                  trainer.state_dict(done)))
        metrics["time/snapshot_s"] = time.perf_counter() - t0
        metrics["time/update_gate_s"] = trainer.gate_wait_s
        metrics["time/wait_for_data_s"] = wait_s
        for k in ("dropped_stale", "dropped_failed", "dropped_circuit_open", "dropped_domain_paused",
                  "duplicates_skipped", "superseded_unsolved", "dropped_unsolved", "dropped_canary", "deferred_groups"):
            metrics[f"train/{k}_total"] = float(buffer.counters[k])
        metrics["train/trained_groups_total"] = float(buffer.counters["trained_groups"] + len(groups))
        snap = StepSnapshot(groups, weights, state, metrics, trainer.version, trainer.step, gate, trainer.adapter)
        self.traces.step(groups, trainer.step, trainer.version, start_ns, time.time_ns(),
                         {k: v for k, v in metrics.items() if k.startswith("time/")})
        self.publishing = asyncio.create_task(self.publisher.publish(snap, self.publishing))
        self.last_step_end = time.perf_counter()


async def _announce_drops(producer, buffer: GroupBuffer, version: int) -> list[Drop]:
    """Send a :class:`GroupDropped` for each group dropped since the last call and wait for the acks;
    returns the drops announced.

    Logged as it happens (the step whose metrics would count it may never come). On a send failure
    the drops go back to the buffer and are retried on the next pass (returns ``[]``); until then nothing
    is committed.
    """
    drops = buffer.take_drops()
    try:
        futs = []
        for d in drops:
            rec = GroupDropped(group_id=d.group_id, reason=d.reason, policy_version=version,
                               behaviour_version=d.behaviour_version, samples=d.samples)
            futs.append(await kafka.send(producer, topics.GROUP_DROPS, rec, d.group_id))
        await asyncio.gather(*futs)
    except asyncio.CancelledError:
        buffer.return_drops(drops)
        raise
    except kafka.PERMANENT_PRODUCE_ERRORS as e:  # no retry can send them: never block the commits on them
        log.error("announcing %d dropped groups was refused (%r); not retried: the scheduler re-issues them at "
                  "their deadline", len(drops), e)
        return drops
    except Exception as e:  # noqa: BLE001 - broker trouble: keep the notices, retry on the next pass
        buffer.return_drops(drops)
        log.warning("announcing %d dropped groups failed (%r); retrying", len(drops), e)
        await asyncio.sleep(0.5)
        return []
    for d in drops:
        log.info("dropped group %s (%s; behaviour version %s, policy version %d, %d samples): slot returned to the "
                 "scheduler", d.group_id, d.reason, d.behaviour_version, version, d.samples)
    return drops


WRITERS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="flywheel-publish")
"""The threads that write (and broadcast) published versions from the live tensors (:meth:`StepSnapshot.in_thread`)."""


class AnnouncementAbandoned(Exception):
    """An announcement given up because the trainer is stopping and the broker is away
    (:meth:`Publisher.abandon`)."""

    def __init__(self, msg: str = "the trainer is stopping with the broker away") -> None:
        super().__init__(msg)


@dataclass
class StepSnapshot:
    """What one optimizer step leaves to publish: copied before the next step changes the model."""

    groups: list[Group]
    """The groups it trained (their offsets are released once the version is durable)."""
    weights: dict[str, torch.Tensor]
    """The new weights, or with LoRA the adapters (:meth:`PolicyTrainer.published_weights`)."""
    state: dict[str, Any]
    """Optimizer, LR schedule, RNG and counters (:meth:`PolicyTrainer.state_dict`)."""
    metrics: dict[str, float]
    """The step's metrics; the publisher adds its own timings (seconds) before sending them."""
    version: int
    """The policy version the step produced."""
    step: int
    """Optimizer steps taken so far."""
    gate: threading.Event | None = None
    """Set once ``weights`` and ``state`` are written (``weights`` and ``state`` are then the live tensors, the
    trainer's :attr:`~trainer_service.trainer.PolicyTrainer.update_gate`); None: they are copies."""
    adapter: AdapterInfo | None = None
    """Set when ``weights`` are LoRA adapters (``trainer.lora``)."""
    _readers: int = field(default=0, init=False, repr=False, compare=False)
    """Jobs of :meth:`in_thread` submitted and not yet finished or cancelled (they may read the live tensors)."""
    _held: threading.Event | None = field(default=None, init=False, repr=False, compare=False)
    """A gate :meth:`release` left closed while readers ran: the last reader to finish opens it."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def release(self) -> None:
        """Let the trainer change the tensors again. Once only: the gate is the trainer's one event, which the
        next step clears again for its own version, so a second release would open it under that version.
        While a job of :meth:`in_thread` is still queued or running (its awaiting task was cancelled, e.g. by
        :meth:`TrainLoop.drain`'s timeout), the gate opens only when that job has finished or was cancelled."""
        with self._lock:
            gate, self.gate = self.gate, None
            if gate is not None and self._readers:
                self._held, gate = gate, None
        if gate is not None:
            gate.set()

    async def in_thread(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a write or broadcast that reads ``weights`` or ``state``) on a publisher thread
        (:data:`WRITERS`), context variables included like :func:`asyncio.to_thread`; returns its result and
        raises what it raises. The job is counted from its submission until it has finished, or was cancelled
        before it started (the future's done-callback runs in both cases), so that a cancelled wait cannot open
        the gate under a running write (:meth:`release`) and a job that never ran cannot keep it shut."""
        with self._lock:
            self._readers += 1
        try:
            job = WRITERS.submit(contextvars.copy_context().run, fn)
        except BaseException:  # not submitted (the pool is shut down): nothing will read
            self._reader_done(None)
            raise
        job.add_done_callback(self._reader_done)
        return await asyncio.wrap_future(job)

    def _reader_done(self, _job) -> None:
        with self._lock:
            self._readers -= 1
            held = self._held if self._readers == 0 else None
            if held is not None:
                self._held = None
        if held is not None:
            held.set()

    def detach(self) -> None:
        """Before the publisher waits on something outside the process (a broker outage, a full disk): copy the
        live tensors and :meth:`release` the trainer, so that its loop keeps turning (intake, control, stop,
        rebuilding its clients) instead of blocking in the next optimizer step. No-op for copies. Call it only
        while no write is reading the tensors (between attempts)."""
        if self.gate is None:
            return
        self.weights = {k: v.detach().clone() for k, v in self.weights.items()}
        self.state = {**self.state, "optimizer": copy.deepcopy(self.state.get("optimizer"))}
        self.release()


class Publisher:
    """Makes each step durable and announces it, in version order (a step's publication overlaps the
    next step's training).

    Per version: write the weights, broadcast them to the live receivers (``weights.transport:
    distributed``; the file stays the fallback), announce the WeightUpdate on flywheel.weights, write
    the trainer state, release the groups' offsets, send the metrics on flywheel.metrics (the run-wide record,
    then one per domain trained: :func:`trainer_service.domain_metrics.domain_metrics`).
    """

    def __init__(self, config: TrainerSettings, store: CheckpointStore, buffer: GroupBuffer, producer,
                 broadcaster=None, metrics: TrainerMetrics | None = None) -> None:
        self.config, self.store, self.buffer, self.producer, self.broadcaster = config, store, buffer, producer, broadcaster
        self.metrics = metrics if metrics is not None else TrainerMetrics()
        """Prometheus families, fed once per published step (and by :class:`TrainLoop`)."""
        t = config.trainer
        self.disk_policy = DiskPolicy(t.disk_reserve_bytes, t.disk_warn_checkpoints)
        self.disk_blocked = False
        """A checkpoint is waiting for disk space: :class:`TrainLoop` takes no new step meanwhile."""
        self.disk_alerted: DiskLevel = "ok"
        """The level of the last ``run/disk_free`` alert sent (``ok``: none firing)."""
        self.disk_steady: DiskLevel = "ok"
        """The last non-critical level of a whole version's check (``ok`` or ``warning``)."""
        self._abandon = asyncio.Event()

    async def _announce(self, topic: str, record, key: str, on_wait: Callable[[], None] | None = None) -> None:
        """Send ``record`` and wait for its ack, retrying a broker error (:data:`shared.kafka.BROKER_ERRORS`)
        with the ``kafka.reconnect_backoff_ms`` back-off until it is acknowledged or :meth:`abandon` is
        called. :attr:`producer` is read again on every attempt: the service replaces it after a broker outage
        (``None`` meanwhile), so a version trained while the broker was away is announced on the broker that
        comes back. ``on_wait`` is called before the first back-off (:meth:`StepSnapshot.detach`).

        Raises:
            AnnouncementAbandoned: :meth:`abandon` was called first (a record already handed to the producer
                may still be delivered).
        """
        attempt = 0
        while True:
            if self._abandon.is_set():
                raise AnnouncementAbandoned()
            producer = self.producer
            try:
                if producer is None:
                    raise kafka.BrokerLost("no producer while the broker is away")
                await kafka.unless_set(_send_and_wait(producer, topic, record, key), self._abandon,
                                       AnnouncementAbandoned)
                return
            except (kafka.BrokerLost, *kafka.BROKER_ERRORS) as e:
                if attempt == 0:
                    log.warning("sending %s to %s failed (%r); retrying until the broker is back",
                                type(record).__name__, topic, e)
                    if on_wait is not None:
                        on_wait()
                await kafka.reconnect_pause(self.config.kafka, attempt, self._abandon)  # ends early at abandon()
                attempt += 1

    def abandon(self) -> None:
        """Give up every announcement now waiting or still to come (:class:`AnnouncementAbandoned`): the
        trainer is stopping and the broker is away. Writes go on. One-way."""
        self._abandon.set()

    @property
    def abandoned(self) -> bool:
        """Whether :meth:`abandon` was called."""
        return self._abandon.is_set()

    async def publish(self, snap: StepSnapshot, previous: asyncio.Task | None) -> None:
        """Publish ``snap`` after ``previous`` (the previous version's publication) has finished.

        Announcements wait out a broker outage (:meth:`_announce`), until :meth:`abandon`: then the version
        is still written whole and its announcements (weights record, metrics records) are given up.

        Raises:
            OSError: the checkpoint could not be written.
        """
        try:
            if previous is not None:
                await previous  # versions become durable and are announced in order
            if self.config.trainer.null_step:
                try:
                    await self._publish_null(snap)
                except AnnouncementAbandoned:
                    log.warning("null step %d's announcements are given up: the trainer stops with the broker away",
                                snap.step)
                return
            await self._publish(snap)
        finally:
            snap.release()  # after a failure too: a trainer blocked at its next step must not hang

    async def _publish(self, snap: StepSnapshot) -> None:
        """:meth:`publish` of a real step: weights, announcement, broadcast, trainer state, metrics."""
        store, metrics, broadcaster = self.store, snap.metrics, self.broadcaster
        t0 = time.perf_counter()
        ids = [g.group_id for g in snap.groups]
        if snap.version >= self.config.budget.max_steps and self.config.trainer.drop_optimizer_on_finish:
            snap.state = {**snap.state, "optimizer": None}  # the run is finished: keep weights and counters only
        need = max(checkpoint_bytes(snap.weights, snap.state), store.version_bytes(snap.version - 1))
        update = await self._durable(snap, lambda: store.save_weights(snap.weights, self.config.model.name,
                                                                      snap.version, snap.step, ids, snap.adapter),
                                     need, snap.version)
        receivers = await asyncio.to_thread(broadcaster.live_receivers) if broadcaster else []
        if receivers:  # the file stays the fallback for anyone outside the session or whose session fails
            await snap.in_thread(lambda: broadcaster.prepare(snap.version, receivers, snap.weights))
            update = update.model_copy(update={"transport": "distributed", "receivers": receivers})
        try:
            await self._announce(topics.WEIGHTS, update, update.model, on_wait=snap.detach)
        except AnnouncementAbandoned:  # stopping, broker away: write the rest; the next start announces it
            log.warning("policy version %d is written but not announced: the trainer stops with the broker away",
                        snap.version)
            receivers = []
        metrics["time/publish_s"] = time.perf_counter() - t0  # step end → version announced, less the snapshot
        if receivers:
            res = await snap.in_thread(lambda: broadcaster.broadcast(snap.version, snap.weights, receivers))
            metrics["weights/broadcast_ok"] = float(res["ok"])
            metrics["weights/broadcast_receivers"] = float(len(receivers))
            metrics["time/broadcast_s"] = res["seconds"]
        await self._durable(snap, lambda: store.save_trainer_state(update, snap.state),
                            checkpoint_bytes({}, snap.state), snap.version, whole=False)
        snap.release()  # written: the next optimizer step may change the tensors
        metrics["time/checkpoint_s"] = time.perf_counter() - t0
        self.buffer.mark_trained(snap.groups)  # their offsets may be committed only now
        self.metrics.published(snap.groups, snap.version, metrics)
        rec = Metrics(source="trainer", step=snap.step, policy_version=snap.version, values=metrics)
        # then one record per domain trained (same key: they follow the run-wide record in its partition)
        per_domain = [Metrics(source="trainer", step=snap.step, policy_version=snap.version, domain=d, values=v)
                      for d, v in domain_metrics(snap.groups, snap.version).items()]
        try:
            for m in [rec, *per_domain]:
                await self._announce(topics.METRICS, m, "trainer")
        except AnnouncementAbandoned:
            log.warning("step %d's metrics are not sent: the trainer stops with the broker away", snap.step)
        log.info("step %d -> policy version %d: reward %.3f loss %.4f (%.1f s train, %.1f s to announce, %.1f s to "
                 "checkpoint, %.1f s waited)", snap.step, snap.version, metrics["train/reward_mean"],
                 metrics["loss/pg"], metrics["time/train_step_s"], metrics["time/publish_s"],
                 metrics["time/checkpoint_s"], metrics["time/wait_for_data_s"])


    async def _publish_null(self, snap: StepSnapshot) -> None:
        """``trainer.null_step``: announce ``snap``'s version with a manifest-less WeightUpdate (no file is
        written: its ``path`` inside the checkpoint store names nothing), release the groups' offsets, send the
        step's metrics (run-wide, then per domain)."""
        t0 = time.perf_counter()
        path = str(self.store.root / f"v{snap.version}" / "null")
        update = WeightUpdate(model=self.config.model.name, version=snap.version, step=snap.step, path=path,
                              manifest=[], checksum=NULL_CHECKSUM)
        await self._announce(topics.WEIGHTS, update, update.model)
        snap.metrics["time/publish_s"] = time.perf_counter() - t0
        self.buffer.mark_trained(snap.groups)
        self.metrics.published(snap.groups, snap.version, snap.metrics)
        await self._announce(topics.METRICS, Metrics(source="trainer", step=snap.step, policy_version=snap.version,
                                                     values=snap.metrics), "trainer")
        for d, v in domain_metrics(snap.groups, snap.version).items():
            await self._announce(topics.METRICS, Metrics(source="trainer", step=snap.step,
                                                         policy_version=snap.version, domain=d, values=v), "trainer")
        log.info("null step %d -> policy version %d: %d groups", snap.step, snap.version, len(snap.groups))

    async def _durable(self, snap: StepSnapshot, write, need: int, version: int, whole: bool = True):
        """``write()`` (a checkpoint phase of ``snap``) in a thread once the store's file system has ``need`` bytes
        free above ``trainer.disk_reserve_bytes``; returns its result. ``whole``: ``need`` is the whole version
        (phase 1), whose check also decides the ``warning`` level; phase 2 (its trainer state, ``whole=False``)
        can only turn it critical, so the level does not flip between the phases of one version. Before its
        first wait it detaches ``snap`` (:meth:`StepSnapshot.detach`): the trainer goes on turning meanwhile.

        While it has not (or the write itself hits a full disk: :class:`shared.checkpoint.DiskFullError`, its
        partial files already removed), :attr:`disk_blocked` holds (no new step), a critical alert is raised
        and the check is retried every ``trainer.disk_retry_s``. Waiting rather than skipping the version:
        rollout engines load only announced versions, so a trainer that trained on without publishing would
        run ahead of them until every group arrived stale; waiting keeps the version order, the commit rule
        and the previous complete checkpoint as they are, and goes on by itself once space is freed.
        """
        while True:
            free = await asyncio.to_thread(self.store.free_bytes)
            level = self.disk_policy.level(free, need)
            if whole and level != "critical":
                self.disk_steady = level
            elif level != "critical":
                level = self.disk_steady
            if whole or level == "critical":
                self.metrics.disk(free, need, level)
            error = None
            if level != "critical":
                try:
                    result = await snap.in_thread(write)  # reads the live tensors
                except DiskFullError as e:
                    error, level = str(e), "critical"
                else:
                    self.disk_blocked = False
                    await self._disk_alert(level, free, need, version)
                    return result
            self.disk_blocked = True
            snap.detach()  # the trainer's loop must keep turning while this waits for space
            self.metrics.checkpoint_waits.inc()
            await self._disk_alert(level, free, need, version, error)
            await asyncio.sleep(self.config.trainer.disk_retry_s)

    async def _disk_alert(self, level: DiskLevel, free: int, need: int, version: int, error: str | None = None) -> None:
        """Log and send a ``run/disk_free`` :class:`Alert` (source ``trainer``) on flywheel.alerts when the level
        changes (``ok`` again: ``resolved``). A failed send is logged only: the log and the gauges remain."""
        if level == self.disk_alerted and error is None:
            return
        changed, previous = level != self.disk_alerted, self.disk_alerted
        self.disk_alerted = level
        root = self.store.root
        if level == "critical":
            msg = (f"checkpoint v{version} needs {need} bytes but {free} are free on {root} (reserve "
                   f"{self.disk_policy.reserve_bytes}){': ' + error if error else ''}; no new step until space is freed "
                   f"(retry every {self.config.trainer.disk_retry_s:g} s; flywheel clean removes finished runs' bulk)")
            log.error(msg)
        elif level == "warning":
            msg = (f"{free} bytes free on {root}: fewer than {self.disk_policy.warn_checkpoints:g} checkpoints of "
                   f"{need} bytes fit above the reserve; the trainer will stop stepping when one no longer fits")
            log.warning(msg)
        else:
            msg = f"{free} bytes free on {root}: checkpoints fit again"
            log.info(msg)
        if not changed:
            return
        status = "resolved" if level == "ok" else "firing"
        severity = previous if level == "ok" else level
        alert = Alert(source="trainer", signal="disk_free", status=status, severity=severity, value=float(free),
                      threshold=float(self.disk_policy.threshold(severity, need)), window=0, window_unit="steps",
                      policy_version=version, message=msg[:4096],
                      details={"path": str(root), "free_bytes": free, "need_bytes": need,
                               "reserve_bytes": self.disk_policy.reserve_bytes})
        try:
            await (await kafka.send(self.producer, topics.ALERTS, alert, alert.key))
        except Exception as e:  # noqa: BLE001 - the broker may be the trouble too; the log line stands
            log.warning("could not send the disk alert (%r)", e)


async def _close(*clients) -> None:
    for c in clients:
        try:
            await c.stop()
        except Exception:  # noqa: BLE001 - best effort during shutdown
            log.exception("error while closing %s", c)
