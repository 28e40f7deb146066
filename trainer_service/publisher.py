"""Publishing a trained version in the background, in version order: write its weights, broadcast them,
announce it on flywheel.weights, write the trainer state, release the trained groups' offsets and send the
step's metrics. An announcement waits out a broker outage; a write waits for disk space.

A version is announced as soon as its weights are durable, before the optimizer state: rollout engines wait
on the announcement, so it is on the critical path of every step (``trainer_service.main``).
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
from typing import Any, Callable

import torch

from shared import kafka, topics
from shared.checkpoint import CheckpointStore
from shared.disk import DiskFullError, DiskLevel, DiskPolicy, checkpoint_bytes
from shared.schemas import AdapterInfo, Alert, Metrics, WeightUpdate
from trainer_service.config import TrainerSettings
from trainer_service.domain_metrics import domain_metrics
from trainer_service.groups import Group, GroupBuffer
from trainer_service.metrics import TrainerMetrics
from trainer_service.null_step import NULL_CHECKSUM

log = logging.getLogger("trainer")


async def send_and_wait(producer, topic: str, record, key: str) -> None:
    """Send ``record`` on ``topic`` and wait for its ack."""
    await (await kafka.send(producer, topic, record, key))


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
        :meth:`trainer_service.loop.TrainLoop.drain`'s timeout), the gate opens only when that job has finished or
        was cancelled."""
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
        """Prometheus families, fed once per published step (and by :class:`trainer_service.loop.TrainLoop`)."""
        t = config.trainer
        self.disk_policy = DiskPolicy(t.disk_reserve_bytes, t.disk_warn_checkpoints)
        self.disk_blocked = False
        """A checkpoint is waiting for disk space: :class:`trainer_service.loop.TrainLoop` takes no new step
        meanwhile."""
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
                await kafka.unless_set(send_and_wait(producer, topic, record, key), self._abandon,
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

        While it has not (or the write itself hits a full disk: :class:`shared.disk.DiskFullError`, its
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
