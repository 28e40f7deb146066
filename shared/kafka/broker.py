"""Outliving a broker restart: the errors that mean the broker went away, the :class:`BrokerWatch` that
notices it, and the helpers a service uses to rebuild its Kafka session.

aiokafka hides a dead broker (``getmany`` returns nothing, errors are only logged) and, after an *empty*
broker comes back on the same port (memory storage: topics and committed offsets gone), a consumer without
a group keeps its old position and silently skips the new topic's first records. A service therefore runs
its Kafka clients as one *session* and rebuilds it whenever its :class:`BrokerWatch` sees the broker go
away (``shared.kafka``'s package docstring has the whole sequence).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import errors as kerr

from shared.config import KafkaConfig
from shared.kafka.clients import client_options

log = logging.getLogger("shared.kafka")


BROKER_ERRORS: tuple[type[BaseException], ...] = (
    kerr.KafkaConnectionError, kerr.NodeNotReadyError, kerr.RequestTimedOutError, kerr.KafkaTimeoutError,
    kerr.UnknownTopicOrPartitionError, kerr.GroupCoordinatorNotAvailableError, kerr.NotCoordinatorForGroupError,
    kerr.LeaderNotAvailableError, kerr.NotLeaderForPartitionError, kerr.BrokerNotAvailableError,
    kerr.NoBrokersAvailable, kerr.KafkaUnavailableError, kerr.CommitFailedError, kerr.IllegalGenerationError,
    kerr.UnknownMemberIdError, kerr.RebalanceInProgressError, kerr.GroupLoadInProgressError,
    kerr.NotEnoughReplicasError, kerr.NotEnoughReplicasAfterAppendError, kerr.StaleMetadata,
    kerr.IllegalStateError, kerr.ConsumerStoppedError, kerr.ProducerClosed, kerr.UnknownError,
    asyncio.TimeoutError, ConnectionError,
)
"""Errors that mean the broker is (or was) unreachable or its cluster state changed under the client:
a service catches them (and :class:`BrokerLost`) around its Kafka session, logs ``broker unreachable,
retrying``, and rebuilds its clients (:meth:`BrokerWatch.wait_up`). ``IllegalStateError`` and
``ConsumerStoppedError`` come from a consumer whose assignment vanished with the broker;
``UnknownError`` is what an empty broker answers for a group it does not know."""


class BrokerLost(Exception):
    """Raised by :meth:`BrokerWatch.check` (and :meth:`BrokerWatch.guard`) once the broker went away after
    the session began: the session's clients must be rebuilt."""


class BrokerWatch:
    """Knows whether the broker is reachable, and whether it went away since a session began.

    One background task holds its own connection to a bootstrap server (with the clients' security
    settings) and sends a small ApiVersions request every ``kafka.probe_interval_ms``. A failed probe, or
    the connection found closed (a broker that dies closes it at once, so a restart between two probes
    is seen too), marks the broker *down*: logged once as ``broker unreachable, retrying``, then
    reconnected with a back-off from ``kafka.reconnect_backoff_ms`` doubling to
    ``kafka.reconnect_backoff_max_ms``. When it answers again :attr:`epoch` goes up by one and the
    outage's length is logged.

    A service reads :attr:`epoch` when its session starts and calls :meth:`check` (or wraps an await in
    :meth:`guard`) as it goes; both raise :class:`BrokerLost` once the broker went away, and the service
    rebuilds its clients after :meth:`wait_up`.
    """

    def __init__(self, cfg: KafkaConfig, name: str) -> None:
        self.cfg, self.name = cfg, name
        self.epoch = 0
        """Times the broker came back after being unreachable since :meth:`start`."""
        self.outages = 0
        """Times it was seen unreachable."""
        self.last_outage_s: float | None = None
        """Seconds from the last loss to the broker answering again."""
        self._up = asyncio.Event()
        self._down = asyncio.Event()
        self._down_since: float | None = None
        self._task: asyncio.Task | None = None
        self._conn = None
        self._closing = False

    @property
    def up(self) -> bool:
        """Whether the last probe got an answer."""
        return self._up.is_set()

    def down_for(self) -> float | None:
        """Seconds since the broker was seen unreachable; ``None`` while it answers (or before the first probe)."""
        if self._up.is_set() or self._down_since is None:
            return None
        return time.monotonic() - self._down_since

    def start(self) -> None:
        """Start probing (on the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"broker-watch-{self.name}")

    async def close(self) -> None:
        """Stop probing and close the connection."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def check(self, epoch: int) -> None:
        """Raise :class:`BrokerLost` if the broker is down now or came back since ``epoch`` was read."""
        if not self.up or self.epoch != epoch:
            raise BrokerLost(f"broker {self.cfg.bootstrap_servers} went away")

    async def guard(self, aw: Awaitable, epoch: int):
        """Await ``aw``; if the broker goes away first, cancel it and raise :class:`BrokerLost` (an ack that
        would otherwise wait ``kafka.request_timeout_ms`` for a dead broker). A coroutine ``aw`` that is not
        awaited (the broker was already gone) is closed."""
        try:
            self.check(epoch)
        except BrokerLost:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise
        return await unless_set(aw, self._down, lambda: BrokerLost(f"broker {self.cfg.bootstrap_servers} went away"))

    async def wait_up(self, stop: asyncio.Event | None = None) -> bool:
        """Wait until the broker answers (or ``stop`` is set); returns whether it is up."""
        self.start()
        waiters = [asyncio.ensure_future(self._up.wait())]
        if stop is not None:
            waiters.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return self.up

    def _lost(self, why: object) -> None:
        conn, self._conn = self._conn, None
        if not self._closing and (self._up.is_set() or self._down_since is None):
            self.outages += self._up.is_set()
            if self._up.is_set():
                log.warning("%s: broker %s unreachable, retrying (%s)", self.name, self.cfg.bootstrap_servers, why)
            else:
                log.info("%s: broker %s not reachable yet (%s); waiting for it", self.name, self.cfg.bootstrap_servers,
                         why)
            self._up.clear()
            self._down.set()
            self._down_since = time.monotonic()
        if conn is not None:
            conn.close()

    def _on_close(self, conn, reason) -> None:
        """aiokafka's close callback: a broker that dies closes the watch's connection at once."""
        if conn is self._conn:
            self._lost(f"connection closed ({reason})")

    def _back(self) -> None:
        if self._up.is_set():
            return
        if self._down_since is not None and self.outages:
            self.epoch += 1
            self.last_outage_s = time.monotonic() - self._down_since
            log.warning("%s: broker %s reachable again after %.1f s", self.name, self.cfg.bootstrap_servers,
                        self.last_outage_s)
        self._down_since = None
        self._down.clear()
        self._up.set()

    async def _connect(self):
        from aiokafka.conn import create_conn

        opts = client_options(self.cfg)
        last: BaseException | None = None
        for server in self.cfg.bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                return await create_conn(
                    host.strip("[]") or "127.0.0.1", int(port or 9092), client_id=f"{self.name}-watch",
                    request_timeout_ms=min(self.cfg.request_timeout_ms, 5000), on_close=self._on_close,
                    ssl_context=opts.get("ssl_context"), security_protocol=self.cfg.security_protocol,
                    sasl_mechanism=opts.get("sasl_mechanism"), sasl_plain_username=opts.get("sasl_plain_username"),
                    sasl_plain_password=opts.get("sasl_plain_password"))
            except (kerr.KafkaError, OSError, asyncio.TimeoutError) as e:
                last = e
        raise kerr.KafkaConnectionError(f"no bootstrap server answers: {last!r}")

    async def _run(self) -> None:
        from aiokafka.protocol.admin import ApiVersionRequest

        cfg = self.cfg
        backoff = cfg.reconnect_backoff_ms
        while True:
            try:
                if self._conn is not None and not self._conn.connected():
                    self._lost("connection closed")
                if self._conn is None:
                    self._conn = await self._connect()
                await asyncio.wait_for(self._conn.send(ApiVersionRequest()), min(cfg.request_timeout_ms, 5000) / 1000)
                self._back()
                backoff = cfg.reconnect_backoff_ms
                try:  # the next probe, or at once when the connection closes
                    await asyncio.wait_for(self._down.wait(), cfg.probe_interval_ms / 1000)
                except asyncio.TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to talk to the broker means it is down
                self._lost(repr(e))
                await asyncio.sleep(backoff / 1000)
                backoff = min(2 * backoff, cfg.reconnect_backoff_max_ms)


async def unless_set(aw: Awaitable, event: asyncio.Event, error: Callable[[], BaseException]):
    """Await ``aw`` and return its result, unless ``event`` is set first: then cancel it and raise ``error()``.
    Cancelled from outside, ``aw`` is cancelled too.

    Raises:
        ``error()``: ``event`` was set before ``aw`` finished.
    """
    task = asyncio.ensure_future(aw)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an error nobody awaits is not logged
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise error()
    return task.result()


async def reconnect_pause(cfg: KafkaConfig, attempt: int, stop: asyncio.Event | None = None) -> None:
    """Sleep the ``attempt``-th (0-based) back-off of a service rebuilding its session:
    ``kafka.reconnect_backoff_ms`` × 2**attempt, capped at ``kafka.reconnect_backoff_max_ms``; returns
    early when ``stop`` is set."""
    delay = min(cfg.reconnect_backoff_ms * 2 ** min(attempt, 20), cfg.reconnect_backoff_max_ms) / 1000
    if stop is None:
        await asyncio.sleep(delay)
        return
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except asyncio.TimeoutError:
        pass


async def stop_clients(*clients, timeout_s: float = 5.0) -> None:
    """Stop each client within ``timeout_s`` seconds (a producer with a dead broker would otherwise wait for
    its unsent batches); errors are logged, never raised. A stop cut short (the bound, or aiokafka's own
    cancellation with the broker gone) is finished by :func:`_close_connections`, within ``timeout_s`` more.

    Raises:
        asyncio.CancelledError: the caller was cancelled meanwhile (after every client is closed).
    """
    cancelled: asyncio.CancelledError | None = None
    for c in clients:
        if c is None:
            continue
        before = _cancels()
        try:
            await asyncio.wait_for(c.stop(), timeout_s)
            continue
        except asyncio.CancelledError as e:
            if _cancels() > before:  # the caller is being cancelled: close every client, then propagate
                cancelled = e
            else:  # aiokafka's consumer re-raises the cancellation of its own heartbeat or coordinator task
                log.info("closing %s: cancelled inside aiokafka; closing its connections", type(c).__name__)
        except Exception as e:  # noqa: BLE001 - closing after a failure; best effort
            log.info("closing %s: %r; closing its connections", type(c).__name__, e)
        await _close_connections(c, timeout_s)
    if cancelled is not None:
        raise cancelled


async def _close_connections(client, timeout_s: float) -> None:
    """Close what an interrupted ``stop()`` did not reach: the producer's sender task, the consumer's fetcher,
    then the network client (its connections and metadata task). Left open, they reconnect to the broker for as
    long as the process lives, one more set after every outage. Each step within ``timeout_s``; errors logged.

    Raises:
        asyncio.CancelledError: the caller was cancelled meanwhile.
    """
    sender, fetcher = getattr(client, "_sender", None), getattr(client, "_fetcher", None)
    net = getattr(client, "_client", None) or getattr(client, "client", None)
    for part in (sender, fetcher, net):
        if part is None:
            continue
        before = _cancels()
        try:
            await asyncio.wait_for(part.close(), timeout_s)
        except asyncio.CancelledError:
            if _cancels() > before:
                raise
        except Exception as e:  # noqa: BLE001 - best effort
            log.info("closing %s's %s: %r", type(client).__name__, type(part).__name__, e)


def _cancels() -> int:
    """Pending cancellation requests of the current task: one more after an await means the task itself was
    cancelled, not only a task inside aiokafka that the await re-raised."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0
