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

This module builds the trainer and runs its Kafka sessions; one pass of the loop is
:class:`trainer_service.loop.TrainLoop`, the background publication of each version
:class:`trainer_service.publisher.Publisher`.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from shared import kafka, topics
from shared.checkpoint import CheckpointStore
from shared.metrics import serve_metrics
from shared.model import load_model, load_tokenizer, resolve_model_dir
from shared.telemetry import flush_tracing
from shared.threads import CoreBurst
from shared.threads import attach as attach_burst
from trainer_service.canary import CanaryCheck
from trainer_service.config import TrainerSettings
from trainer_service.control import ControlState, read_control_to_end
from trainer_service.groups import GroupBuffer
from trainer_service.loop import TrainLoop
from trainer_service.metrics import TrainerMetrics
from trainer_service.null_step import NULL_LEDGER, NullTrainer
from trainer_service.publisher import Publisher, send_and_wait
from trainer_service.trainer import PolicyTrainer

log = logging.getLogger("trainer")


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
                   publisher: Publisher, control: ControlState, held: dict[str, TrainLoop],
                   stop: asyncio.Event) -> TrainLoop:
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
            await watch.guard(send_and_wait(producer, topics.WEIGHTS, latest, latest.model), epoch)
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


async def _close(*clients) -> None:
    for c in clients:
        try:
            await c.stop()
        except Exception:  # noqa: BLE001 - best effort during shutdown
            log.exception("error while closing %s", c)
