"""Weight intake of the rollout service: which policy versions exist, and how the engine gets them.

* :class:`WeightWatcher` collects every announced :class:`~shared.schemas.WeightUpdate`: from
  flywheel.weights, read without a consumer group (every replica sees every version, from the earliest
  offset), and at start-up from the checkpoint store's newest manifest, so a replica that joins late or
  lost the broker still catches up. A version whose file cannot be loaded is marked bad and skipped.
* :class:`BroadcastFollower` (``weights.transport: distributed``) joins each version's torch.distributed
  broadcast session (``shared/weight_sync.py``) while the engine keeps generating; the checkpoint file
  stays the fallback.
* :func:`apply_newest` loads the newest good version between batches (from its broadcast when this
  engine received it, else from its checkpoint).
* :class:`WeightIntake` owns all of the above for one service run, and the rollout loop talks only to
  it: :meth:`~WeightIntake.apply_newest` between batches, :meth:`~WeightIntake.wait_for` to block a
  batch until its ``min_policy_version`` is loaded; its background tasks (the watcher, the broadcast
  follower and, with ``rollout.weight_update_policy: interrupt``, the interrupter that hands a new
  version to the engine mid-generation) start with :meth:`~WeightIntake.start` and end with
  :meth:`~WeightIntake.close`.

Blocking engine calls (loading weights, receiving a broadcast) run in worker threads; everything here
runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable

import httpx

from rollout_service.config import RolloutSettings
from rollout_service.engine import Engine
from shared.checkpoint import CheckpointStore
from shared.kafka import BROKER_ERRORS
from shared.schemas import DecodeError, WeightUpdate, decode

log = logging.getLogger("rollout")

LOAD_ERRORS = (OSError, ValueError, RuntimeError, httpx.HTTPError)
"""Errors of a weight load (missing file, bad checksum, a refused server update): the version is skipped."""


class WeightWatcher:
    """Every announced WeightUpdate by version, from flywheel.weights and the checkpoint store.

    A version that cannot be loaded (missing file, bad checksum, a path outside the checkpoint
    store) is marked bad and skipped, so one bad record never blocks the newer good ones.
    ``changed`` is set whenever a new version is offered (waiters clear it before waiting).
    """

    def __init__(self, store_root: Path | None = None) -> None:
        self.updates: dict[int, WeightUpdate] = {}
        self.bad: set[int] = set()
        self.store_root = store_root.resolve() if store_root else None
        self.changed = asyncio.Event()

    @property
    def newest(self) -> WeightUpdate | None:
        """The highest version not marked bad."""
        good = [v for v in self.updates if v not in self.bad]
        return self.updates[max(good)] if good else None

    def offer(self, update: WeightUpdate | None) -> None:
        """Record ``update`` unless it is None, already known, or (with a store root) its path lies
        outside the checkpoint store (logged and ignored: a forged record must not load arbitrary files)."""
        if update is None or update.version in self.updates:
            return
        if self.store_root is not None and (
            update.path is None or not Path(update.path).resolve().is_relative_to(self.store_root)
        ):
            log.error("ignoring weight version %d: path %s is outside the checkpoint store %s", update.version,
                      update.path, self.store_root)
            return
        self.updates[update.version] = update
        self.changed.set()

    async def follow(self, consumer, stop: asyncio.Event) -> None:
        """Read every weight record (no group, all partitions, from earliest) until ``stop``; malformed
        records are logged and skipped. A broker error (:data:`shared.kafka.BROKER_ERRORS`) is logged and
        the read retried a second later (the service rebuilds ``consumer`` after an outage); before this the
        task died of it silently and the replica never saw another version."""
        while not stop.is_set():
            try:
                batch = await consumer.getmany(timeout_ms=200)
            except BROKER_ERRORS as e:
                log.warning("reading flywheel.weights failed (%r); retrying", e)
                await asyncio.sleep(1.0)
                continue
            for msgs in batch.values():
                for msg in msgs:
                    try:
                        self.offer(decode(msg.value, WeightUpdate))
                    except DecodeError as e:
                        log.warning("ignoring malformed weight record at offset %d: %s", msg.offset, e.reason)


class BroadcastFollower:
    """Transport ``distributed``: registers with the trainer's store and joins each version's broadcast
    session as soon as the version is announced (while the engine keeps generating). A torch engine's
    weights are staged for :func:`apply_newest` to load between batches (or between decode steps); an
    SGLang server receives them into its own weights at once (paused in ``rollout.sglang_pause_mode``, so
    requests in flight continue under the new version, their spans tagged). A failed session leaves the
    version to the checkpoint file.

    ``stats`` counts ``weights/broadcast_received`` and ``weights/broadcast_failed`` sessions (reported
    with the rollout metrics).
    """

    def __init__(self, config: RolloutSettings, engine: Engine, watcher: WeightWatcher) -> None:
        self.wc = config.weights
        self.engine, self.watcher = engine, watcher
        self.id = f"rollout-{socket.gethostname()}-{os.getpid()}"
        self.staged: tuple[int, dict] | None = None
        self.receiving: int | None = None
        self.received = asyncio.Event()
        self.stats = {"weights/broadcast_received": 0.0, "weights/broadcast_failed": 0.0}
        self._seen: set[int] = set()
        self.registered = False

    def member(self, update: WeightUpdate) -> bool:
        """Whether this engine is in ``update``'s broadcast session."""
        return self.registered and update.transport == "distributed" and self.id in update.receivers

    async def _register(self, stop: asyncio.Event):
        """A ``WeightReceiver`` registered with the trainer's store, retrying every second until it is
        up (the trainer may start after us); None when ``stop`` is set first."""
        from shared.weight_sync import WeightReceiver

        while not stop.is_set():
            try:
                return await asyncio.to_thread(WeightReceiver, self.wc.broadcast_host, self.wc.broadcast_port,
                                               self.id, self.wc.broadcast_timeout_s, self.wc.broadcast_backend,
                                               width=self.engine.broadcast_width)
            except (RuntimeError, OSError) as e:
                log.info("weight broadcast store not reachable yet (%s); retrying", e)
                await asyncio.sleep(1.0)
        return None

    async def run(self, stop: asyncio.Event) -> None:
        """Register (retrying until the trainer's store is up), then receive each announced session
        this engine belongs to, until ``stop``. Only the newest pending version is joined; older
        sessions fail for want of us and fall back to their checkpoints, harmlessly."""
        receiver = await self._register(stop)
        if receiver is None:
            return
        like = {} if self.engine.receives_in_server else await asyncio.to_thread(self.engine.weight_shapes)
        self.registered = True
        log.info("registered for weight broadcasts as %s", self.id)
        try:
            while not stop.is_set():
                todo = sorted(v for v, u in self.watcher.updates.items()
                              if v not in self._seen and self.member(u) and v > self.engine.policy_version)
                if not todo:
                    await asyncio.sleep(0.02)
                    continue
                self._seen.update(todo)
                await self._receive(receiver, todo[-1], like)
        finally:
            self.registered = False
            receiver.close()

    async def _receive(self, receiver, v: int, like: dict) -> None:
        """Join version ``v``'s session: into the server (SGLang) or staged for :meth:`take` (torch,
        tensors shaped like ``like``). Never raises: a failure is counted, logged, and left to the
        checkpoint file."""
        self.receiving = v
        t0 = time.perf_counter()
        try:
            took = True
            if self.engine.receives_in_server:
                rank, world = await asyncio.to_thread(receiver.session, v)
                plan = await asyncio.to_thread(receiver.plan, v)
                took = await asyncio.to_thread(self.engine.receive_broadcast, self.watcher.updates[v], rank, world,
                                               plan, self.wc.broadcast_host, self.wc.broadcast_port,
                                               self.wc.broadcast_backend, self.wc.broadcast_timeout_s)
            else:
                self.staged = (v, await asyncio.to_thread(receiver.receive, v, like))
            if took:
                self.stats["weights/broadcast_received"] += 1
                log.info("received policy version %d by broadcast in %.2f s", v, time.perf_counter() - t0)
            else:
                log.info("policy version %d was already loaded from its checkpoint", v)
        except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:
            self.stats["weights/broadcast_failed"] += 1
            log.warning("broadcast of policy version %d failed (%s); loading it from the checkpoint", v, e)
        except Exception as e:  # noqa: BLE001 - the follower must outlive any one session
            self.stats["weights/broadcast_failed"] += 1
            log.exception("broadcast of policy version %d failed unexpectedly (%s); loading it from the "
                          "checkpoint", v, e)
        finally:
            self.receiving = None
            self.received.set()

    async def take(self, update: WeightUpdate) -> dict | None:
        """The staged broadcast weights of ``update`` once its session is over (waiting for it, at most the
        broadcast timeout + 5 s); None when there are none: this engine is not in the session, the session
        failed, or the server received them in place (its ``policy_version`` then says so)."""
        v = update.version
        deadline = time.monotonic() + self.wc.broadcast_timeout_s + 5
        while self.member(update) and (v not in self._seen or self.receiving == v) and time.monotonic() < deadline:
            self.received.clear()
            try:
                await asyncio.wait_for(self.received.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        if self.staged is not None and self.staged[0] == v:
            state, self.staged = self.staged[1], None
            return state
        return None


async def apply_newest(engine: Engine, watcher: WeightWatcher, follower: BroadcastFollower | None = None) -> None:
    """Load the newest good version if it is newer than the engine's (in a worker thread): from its
    broadcast when this engine received it, else from its checkpoint file. A version that fails to load
    (:data:`LOAD_ERRORS`) is marked bad and the next newest is tried; never raises those."""
    while (upd := watcher.newest) is not None and upd.version > engine.policy_version:
        t0 = time.perf_counter()
        try:
            state = await follower.take(upd) if follower is not None else None
            if engine.policy_version >= upd.version:
                return  # the server received it in place
            if state is not None:
                await asyncio.to_thread(engine.load_weights_state, state, upd.version)
                how = "broadcast"
            else:
                await asyncio.to_thread(engine.update_weights, upd)
                how = "checkpoint"
            log.info("loaded policy version %d (%s) in %.2f s", upd.version, how, time.perf_counter() - t0)
            return
        except LOAD_ERRORS as e:
            log.error("cannot load policy version %d, skipping it: %s", upd.version, e)
            watcher.bad.add(upd.version)


class WeightIntake:
    """The weight side of one service run: a :class:`WeightWatcher` seeded from the checkpoint store
    (``run.checkpoint_dir``), a :class:`BroadcastFollower` when ``weights.transport == "distributed"``,
    and the interrupter when ``rollout.weight_update_policy == "interrupt"``.

    The rollout loop calls :meth:`apply_newest` and :meth:`wait_for` between batches; the background
    tasks run from :meth:`start` until :meth:`close`.
    """

    def __init__(self, config: RolloutSettings, engine: Engine) -> None:
        self.config, self.engine = config, engine
        store_root = config.run.path(config.run.checkpoint_dir)
        self.watcher = WeightWatcher(store_root)
        self.store = CheckpointStore(store_root)
        self.reseed()
        self.follower = (BroadcastFollower(config, engine, self.watcher)
                         if config.weights.transport == "distributed" else None)
        self._tasks: list[asyncio.Task] = []
        self._follow: asyncio.Task | None = None
        self._first_token_version = engine.policy_version
        self.on_load: Callable[[float], None] | None = None
        """Called with the seconds of every :meth:`apply_newest` that changed the engine's version."""

    @property
    def stats(self) -> dict[str, float]:
        """The broadcast counters (empty without a follower)."""
        return self.follower.stats if self.follower is not None else {}

    def start(self, weights_consumer, stop: asyncio.Event) -> None:
        """Start following flywheel.weights on ``weights_consumer`` (started, no group), the broadcast
        sessions and the interrupter, each until ``stop``."""
        policy = self.config.rollout.weight_update_policy
        self.follow(weights_consumer, stop)
        if self.follower is not None:
            self._tasks.append(asyncio.create_task(self.follower.run(stop)))
            if self.engine.receives_in_server and policy == "finish":
                log.warning("rollout.weight_update_policy=finish: an SGLang server takes a broadcast version as it "
                            "arrives (paused in rollout.sglang_pause_mode: requests in flight continue under it, their "
                            "spans tagged)")
        if policy == "interrupt":
            self._tasks.append(asyncio.create_task(self._interrupt_on_new_weights(stop)))

    def reseed(self) -> None:
        """Offer the checkpoint store's newest published version to the watcher (the trainer writes it there
        before announcing it). A broker that lost flywheel.weights (an empty broker after a restart) never
        replays the announcements, so this is how a replica started, or reconnected, after that still
        finds the newest version. Never raises: an unreadable store is logged."""
        try:
            self.watcher.offer(self.store.newest_published())
        except (OSError, ValueError) as e:
            log.warning("cannot read the checkpoint store %s: %s", self.store.root, e)

    def follow(self, weights_consumer, stop: asyncio.Event) -> None:
        """(Re)start following flywheel.weights on ``weights_consumer`` (started, no group, from the earliest
        offset), replacing the consumer followed so far (the service rebuilds its clients after a broker
        outage), and :meth:`reseed` from the checkpoint store."""
        if self._follow is not None:
            self._follow.cancel()
        self.reseed()
        self._follow = asyncio.create_task(self.watcher.follow(weights_consumer, stop))
        self._tasks.append(self._follow)

    async def stop_following(self) -> None:
        """Stop reading flywheel.weights (before its consumer is closed); the watcher keeps what it knows."""
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
            self._tasks.remove(self._follow)
            self._follow = None

    async def apply_newest(self) -> None:
        """:func:`apply_newest` with this run's watcher and follower (timed for :attr:`on_load`)."""
        before, t0 = self.engine.policy_version, time.perf_counter()
        await apply_newest(self.engine, self.watcher, self.follower)
        if self.on_load is not None and self.engine.policy_version != before:
            self.on_load(time.perf_counter() - t0)

    async def wait_for(self, version: int, stop: asyncio.Event) -> None:
        """Until the engine holds ``version`` (or ``stop``): wait for a new announcement (at most
        ``10 * rollout.weight_poll_s`` seconds at a time; after each such wait the checkpoint store is read
        too, :meth:`reseed`, in case the announcement was lost with the broker), then :meth:`apply_newest`."""
        while self.engine.policy_version < version and not stop.is_set():
            log.info("waiting for policy version %d (have %d)", version, self.engine.policy_version)
            self.watcher.changed.clear()
            try:
                await asyncio.wait_for(self.watcher.changed.wait(), self.config.rollout.weight_poll_s * 10)
            except asyncio.TimeoutError:
                self.reseed()
            await self.apply_newest()

    async def _interrupt_on_new_weights(self, stop: asyncio.Event) -> None:
        """``weight_update_policy: interrupt``: hand every newer announced version to the engine at once, to
        be loaded between two decode steps of the running batch (the loop's :meth:`apply_newest` still
        loads it between batches if the engine cannot). A version an SGLang server receives by broadcast
        is left to the follower, which interrupts in the server. Polls every 50 ms until ``stop``."""
        engine, follower = self.engine, self.follower
        asked = engine.policy_version
        while not stop.is_set():
            upd = self.watcher.newest
            if upd is not None and engine.receives_in_server and follower is not None and follower.member(upd):
                asked = max(asked, upd.version)
            if upd is not None and upd.version > max(asked, engine.policy_version):
                try:
                    if await asyncio.to_thread(engine.interrupt_with, upd):
                        log.info("policy version %d: interrupting generation to load it", upd.version)
                except LOAD_ERRORS as e:
                    log.warning("policy version %d: could not interrupt generation for it (%s); it loads between "
                                "batches", upd.version, e)
                asked = upd.version
            await asyncio.sleep(0.05)  # polls: the loop's own waits own watcher.changed

    def first_generation_lag(self) -> float | None:
        """Seconds from the announcement of the engine's version to now, the first time a batch is
        generated with a new announced version (logged); None otherwise."""
        v = self.engine.policy_version
        if v == self._first_token_version or v not in self.watcher.updates:
            return None
        lag = time.time() - self.watcher.updates[v].created_at
        log.info("policy version %d: %.3f s from its announcement to its first generation", v, lag)
        self._first_token_version = v
        return lag

    async def close(self) -> None:
        """Cancel the background tasks and wait for them (their errors are dropped)."""
        for t in self._tasks:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
        self._tasks.clear()
