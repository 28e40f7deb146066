"""Trainer service: consume scored trajectories, step on complete groups, publish weight versions.

Loop: ``getmany`` → buffer records into groups → (drop stale) → announce every group dropped
(stale, failed, superseded) on flywheel.group_drops and wait for the acks, so the scheduler gives
its slot back → when ``batch_groups`` groups are ready, one optimizer step in a worker thread → snapshot weights and state → (in the background,
in version order) write the version's weights, announce it on flywheel.weights, write the trainer
state, send the step's metrics on flywheel.metrics, and only then release the trained groups' offsets →
commit, per partition, the oldest offset not yet trained-and-durable or dropped.

Writing a checkpoint overlaps the next optimizer step. A version is announced as soon as its
weights are durable (~1 s for SmolLM2 here), before the optimizer state (~1.5 s more): rollout
engines wait on the announcement, so it is on the critical path of every step. A crash never
leaves a rollout engine holding weights the restarted trainer does not have: the trainer resumes
at the newest published version (:func:`build_trainer`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from aiokafka import TopicPartition

from shared import kafka, topics
from shared.checkpoint import CheckpointStore, load_weights, snapshot_weights
from trainer_service.config import TrainerSettings
from shared.model import load_model, load_tokenizer, resolve_model_dir
from shared.schemas import GroupDropped, Metrics, ScoredTrajectory
from trainer_service.groups import GroupBuffer
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
    trainer = PolicyTrainer(load_model(model_dir, cfg.dtype), cfg, tok.pad_token_id, config.budget.max_steps)
    store = CheckpointStore(config.run.path(config.run.checkpoint_dir), cfg.keep_checkpoints)
    done: set[str] = set()
    complete, published = store.latest(), store.newest_published()
    if complete is not None:
        state = store.load_trainer_state(complete.version)
        if state is None:
            raise RuntimeError(f"checkpoint v{complete.version} has weights but no trainer state")
        done = trainer.load_state_dict(state)
    if published is not None:
        load_weights(trainer.model, published)
        if complete is None or published.version != complete.version:
            log.warning("policy version %d was published without its trainer state: resuming at it with the "
                        "optimizer state of version %s", published.version,
                        complete.version if complete else "0 (fresh)")
            trainer.step, trainer.version = published.step, published.version
            done |= store.trained_groups(published.version)
        log.info("resumed at policy version %d (step %d, %d groups done)", trainer.version, trainer.step, len(done))
    return trainer, store, done


async def run(config: TrainerSettings, stop: asyncio.Event | None = None) -> None:
    """Run the trainer until ``stop`` is set (SIGTERM/SIGINT set it when ``stop`` is None)."""
    stop, _ = kafka.prepare_service("trainer", config, stop)
    cfg = config.trainer
    trainer, store, done = await asyncio.to_thread(build_trainer, config)
    buffer = GroupBuffer(config.budget.max_staleness, done, config.budget.resample_unsolved)
    await kafka.ensure_topics(config.kafka)
    producer = kafka.make_producer(config.kafka, "trainer")
    consumer = kafka.make_consumer(config.kafka, topics.SCORED, group_id="trainer", client_id="trainer")
    broadcaster = None
    if config.weights.transport == "distributed":
        from shared.weight_sync import WeightBroadcaster

        broadcaster = await asyncio.to_thread(WeightBroadcaster, config.weights.broadcast_host,
                                              config.weights.broadcast_port, config.weights.broadcast_backend,
                                              config.weights.broadcast_timeout_s)
        log.info("weight broadcast store on %s:%d", config.weights.broadcast_host, config.weights.broadcast_port)
    await producer.start()
    latest = store.newest_published()
    if latest is not None:  # re-announce: the broker may have lost the record (or it was never sent)
        await (await kafka.send(producer, topics.WEIGHTS, latest, latest.model))
    await consumer.start()
    try:
        last_step_end = last_report = time.perf_counter()
        publishing: asyncio.Task | None = None
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200, max_records=1024)
            for tp, msgs in batch.items():
                for msg in msgs:
                    scored = await kafka.decode_or_dead_letter(producer, msg, ScoredTrajectory, "trainer")
                    buffer.add(scored, (tp.topic, tp.partition), msg.offset)
            if trainer.version < config.budget.max_steps:
                buffer.drop_stale(trainer.version)
            if buffer.has_drops:
                await _announce_drops(producer, buffer, trainer.version)
            if trainer.version < config.budget.max_steps:
                if len(buffer.ready) >= config.budget.batch_groups:
                    wait_s = time.perf_counter() - last_step_end
                    publishing = await _step(config, trainer, store, buffer, producer, wait_s, publishing,
                                             broadcaster)
                    last_step_end = time.perf_counter()
                elif time.perf_counter() - max(last_step_end, last_report) > cfg.stall_report_s:
                    last_report = time.perf_counter()
                    log.warning("no step for %.0f s at policy version %d (assigned %s): %s", last_report - last_step_end,
                                trainer.version, sorted(consumer.assignment()), buffer.describe())
            if publishing is not None and publishing.done():
                publishing.result()  # surface a failed save or send
            offsets = {TopicPartition(t, p): o for (t, p), o in buffer.commit_offsets().items()}
            if offsets and not buffer.has_drops:  # a drop not yet acknowledged keeps its records uncommitted
                await consumer.commit(offsets)
        if publishing is not None:  # graceful stop: finish announcing what was trained
            await asyncio.wait_for(publishing, timeout=120)
            offsets = {TopicPartition(t, p): o for (t, p), o in buffer.commit_offsets().items()}
            if offsets and not buffer.has_drops:
                await consumer.commit(offsets)
    except asyncio.CancelledError:
        raise
    finally:
        await asyncio.wait_for(_close(consumer, producer), timeout=15)
        log.info("trainer stopped at policy version %d", trainer.version)


async def _announce_drops(producer, buffer: GroupBuffer, version: int) -> None:
    """Send a :class:`GroupDropped` for each group dropped since the last call and wait for the acks.

    Logged as it happens (the step whose metrics would count it may never come). On a send failure
    the drops go back to the buffer and are retried on the next pass; until then nothing is committed.
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
    except Exception as e:  # noqa: BLE001 - broker trouble: keep the notices, retry on the next pass
        buffer.return_drops(drops)
        log.warning("announcing %d dropped groups failed (%r); retrying", len(drops), e)
        await asyncio.sleep(0.5)
        return
    for d in drops:
        log.info("dropped group %s (%s; behaviour version %s, policy version %d, %d samples): slot returned to the "
                 "scheduler", d.group_id, d.reason, d.behaviour_version, version, d.samples)


async def _step(config: TrainerSettings, trainer: PolicyTrainer, store: CheckpointStore, buffer: GroupBuffer,
                producer, wait_s: float, previous: asyncio.Task | None, broadcaster=None) -> asyncio.Task:
    """Train one step now; return the task that makes it durable and announces it (after ``previous``)."""
    cfg = config.trainer
    # with oversampling (budget.oversample > 1) the scheduler issues more groups than a step takes:
    # pick those whose rewards differ first; the rest wait for the next step or go stale (counted)
    groups = buffer.take(config.budget.batch_groups, prefer_informative=config.budget.oversample > 1)
    metrics = await asyncio.to_thread(trainer.train_step, groups)
    t0 = time.perf_counter()
    done = buffer.done_groups | buffer.in_flight  # includes earlier steps still being saved
    weights, state = await asyncio.to_thread(lambda: (snapshot_weights(trainer.model), trainer.state_dict(done)))
    metrics["time/snapshot_s"] = time.perf_counter() - t0
    metrics["time/wait_for_data_s"] = wait_s
    for k in ("dropped_stale", "dropped_failed", "duplicates_skipped", "superseded_unsolved"):
        metrics[f"train/{k}_total"] = float(buffer.counters[k])
    metrics["train/trained_groups_total"] = float(buffer.counters["trained_groups"] + len(groups))
    return asyncio.create_task(_publish(config, store, buffer, producer, groups, weights, state, metrics,
                                        trainer.version, trainer.step, previous, broadcaster))


async def _publish(config: TrainerSettings, store: CheckpointStore, buffer: GroupBuffer, producer, groups,
                   weights, state, metrics: dict, version: int, step: int, previous: asyncio.Task | None,
                   broadcaster=None) -> None:
    if previous is not None:
        await previous  # versions become durable and are announced in order
    t0 = time.perf_counter()
    ids = [g.group_id for g in groups]
    update = await asyncio.to_thread(store.save_weights, weights, config.model.name, version, step, ids)
    receivers = await asyncio.to_thread(broadcaster.live_receivers) if broadcaster else []
    if receivers:  # the file stays the fallback for anyone outside the session or whose session fails
        await asyncio.to_thread(broadcaster.prepare, version, receivers, weights)
        update = update.model_copy(update={"transport": "distributed", "receivers": receivers})
    await (await kafka.send(producer, topics.WEIGHTS, update, update.model))
    metrics["time/publish_s"] = time.perf_counter() - t0  # step end → version announced, less the snapshot
    if receivers:
        res = await asyncio.to_thread(broadcaster.broadcast, version, weights, receivers)
        metrics["weights/broadcast_ok"] = float(res["ok"])
        metrics["weights/broadcast_receivers"] = float(len(receivers))
        metrics["time/broadcast_s"] = res["seconds"]
    await asyncio.to_thread(store.save_trainer_state, update, state)
    metrics["time/checkpoint_s"] = time.perf_counter() - t0
    buffer.mark_trained(groups)  # their offsets may be committed only now
    rec = Metrics(source="trainer", step=step, policy_version=version, values=metrics)
    await (await kafka.send(producer, topics.METRICS, rec, "trainer"))
    log.info("step %d -> policy version %d: reward %.3f loss %.4f (%.1f s train, %.1f s to announce, %.1f s to "
             "checkpoint, %.1f s waited)", step, version, metrics["train/reward_mean"], metrics["loss/pg"],
             metrics["time/train_step_s"], metrics["time/publish_s"], metrics["time/checkpoint_s"],
             metrics["time/wait_for_data_s"])


async def _close(*clients) -> None:
    for c in clients:
        try:
            await c.stop()
        except Exception:  # noqa: BLE001 - best effort during shutdown
            log.exception("error while closing %s", c)
