"""aiokafka helpers: producers with acks=all, manual-commit consumers, topic creation, dead letters,
records that cannot be produced, and the broker watch that lets a service outlive a broker restart.

The delivery contract (DESIGN.md, "Delivery semantics") is at-least-once: a consumer commits an
offset only after everything it produced for that record is acknowledged. The embedded broker
has no idempotent producer and wrong "latest" offsets, so producers never enable idempotence and
consumers start from committed or earliest offsets.

Every client gets the same connection settings from :class:`shared.config.KafkaConfig`
(:func:`client_options`: metadata refresh, retry back-off, request timeout, and the optional
SASL/SSL security of an external Apache Kafka).

Broker outages: aiokafka hides a dead broker (``getmany`` returns nothing, errors are only
logged) and, after an *empty* broker comes back on the same port (memory storage: topics and committed
offsets gone), a consumer without a group keeps its old position and silently skips the new topic's
first records (measured: at position 5, records 0..4 of the new topic were never returned). A service
therefore runs its Kafka clients as one *session* and rebuilds it whenever its :class:`BrokerWatch`
sees the broker go away: close the clients, wait until the broker answers, :func:`ensure_topics`,
start new clients (group consumers re-join and start at the committed offsets, else the earliest;
group-less ones at the earliest), as a process restart would, without reloading models.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka import errors as kerr
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from shared import topics
from shared.config import KafkaConfig
from shared.schemas import DeadLetter, DecodeError, Record, Trajectory, decode
from shared.telemetry import inject_headers, setup_logging, setup_tracing

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)


def _secret_file(path: str) -> str:
    """The first line of ``path`` (``~`` expanded), stripped.

    Raises:
        OSError: the file cannot be read (the message names the file, never its content).
    """
    return Path(os.path.expanduser(path)).read_text().splitlines()[0].strip() if path else ""


def client_options(cfg: KafkaConfig) -> dict:
    """The keyword arguments every aiokafka client of a service shares: bootstrap servers, metadata
    refresh (``kafka.metadata_max_age_ms``: 5 s, not aiokafka's 5 minutes), retry back-off, request
    timeout, idle close, and the security settings (``kafka.security_protocol``: SASL user and password,
    an SSL context from :func:`aiokafka.helpers.create_ssl_context` with the CA, client certificate and
    key). The password is read from ``sasl_plain_password`` or its file, and is never logged.

    Raises:
        OSError: a password, CA, certificate or key file cannot be read.
        ssl.SSLError: the certificate or key is invalid.
    """
    opts: dict = dict(
        bootstrap_servers=cfg.bootstrap_servers,
        metadata_max_age_ms=cfg.metadata_max_age_ms,
        request_timeout_ms=cfg.request_timeout_ms,
        retry_backoff_ms=cfg.retry_backoff_ms,
        connections_max_idle_ms=cfg.connections_max_idle_ms,
        security_protocol=cfg.security_protocol,
    )
    if cfg.security_protocol.startswith("SASL_"):
        password = (cfg.sasl_plain_password.get_secret_value() if cfg.sasl_plain_password is not None
                    else _secret_file(cfg.sasl_plain_password_file or ""))
        opts.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_plain_username,
                    sasl_plain_password=password)
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        key_password = _secret_file(cfg.ssl_keyfile_password_file) if cfg.ssl_keyfile_password_file else None
        opts["ssl_context"] = create_ssl_context(cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile,
                                                 keyfile=cfg.ssl_keyfile, password=key_password)
    return opts


def make_producer(cfg: KafkaConfig, client_id: str = "flywheel") -> AIOKafkaProducer:
    """A producer that waits for acks from all in-sync replicas (not started), with
    :func:`client_options`."""
    return AIOKafkaProducer(
        **client_options(cfg),
        client_id=client_id,
        acks="all",
        enable_idempotence=False,  # the embedded broker cannot (notes/tansu-broker.md)
        compression_type=cfg.compression,
        max_request_size=cfg.max_request_size,
        linger_ms=5,
    )


def make_consumer(
    cfg: KafkaConfig, *topic_names: str, group_id: str | None, client_id: str = "flywheel",
    offset_reset: str = "earliest",
) -> AIOKafkaConsumer:
    """A manual-commit consumer starting from committed offsets, else ``offset_reset`` (``earliest`` or
    ``latest``; not started), with :func:`client_options`.

    With ``group_id=None`` the consumer has no group and no commits (e.g. every rollout replica
    reading every weight version).
    """
    return AIOKafkaConsumer(
        *topic_names,
        **client_options(cfg),
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset=offset_reset,
        fetch_max_wait_ms=cfg.fetch_max_wait_ms,
        max_partition_fetch_bytes=cfg.max_request_size,
        fetch_max_bytes=4 * cfg.max_request_size,
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=max(1000, cfg.session_timeout_ms // 4),
    )


def make_admin(cfg: KafkaConfig, client_id: str = "flywheel-admin") -> AIOKafkaAdminClient:
    """An admin client (not started) with :func:`client_options`."""
    return AIOKafkaAdminClient(**client_options(cfg), client_id=client_id)


class TopicLayoutError(RuntimeError):
    """Topics exist with fewer partitions than the system is configured for (``short``: name → (have, want)).

    A topic a client touched before anyone created it is auto-created by the broker with the broker's default
    count (Tansu: 4), which caps the consumers of a group at that count (``../shared/notes/tansu-broker.md``);
    Tansu cannot add partitions (no CreatePartitions), so the fix is to delete the topic or start a fresh
    broker."""

    def __init__(self, short: dict[str, tuple[int, int]]) -> None:
        self.short = short
        super().__init__("topics with fewer partitions than configured (kafka.partitions): " + ", ".join(
            f"{n} has {have}, wants {want}" for n, (have, want) in sorted(short.items()))
            + "; a client created them before the system did: delete them or start a fresh broker")


async def ensure_topics(cfg: KafkaConfig, names: Iterable[str] = topics.ALL, strict: bool = False
                        ) -> dict[str, tuple[int, int]]:
    """Create the topics that do not exist yet, with the partition counts of ``shared.topics``, then check the
    partition count of every one of ``names``.

    Returns:
        The topics with fewer partitions than :func:`shared.topics.partitions_for` wants, name → (have, want);
        each is logged as an error (consumers past ``have`` in a group stay idle). More partitions than wanted
        are fine.

    Raises:
        TopicLayoutError: ``strict`` and some topic has fewer partitions than wanted (the launcher, before any
            service starts).
        aiokafka.errors.KafkaError: the broker cannot be reached (see :data:`BROKER_ERRORS`).
    """
    names = list(names)
    admin = make_admin(cfg)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(n, num_partitions=topics.partitions_for(n, cfg.partitions), replication_factor=1)
            for n in names
            if n not in existing
        ]
        if new:
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
        short: dict[str, tuple[int, int]] = {}
        for t in await admin.describe_topics(names):
            want = topics.partitions_for(t["topic"], cfg.partitions)
            have = len(t.get("partitions") or [])
            if not t.get("error_code") and have < want:
                short[t["topic"]] = (have, want)
    finally:
        await admin.close()
    if short:
        err = TopicLayoutError(short)
        if strict:
            raise err
        log.error("%s", err)
    return short


async def send(producer: AIOKafkaProducer, topic: str, record: Record, key: str) -> asyncio.Future:
    """Queue ``record`` on ``topic`` with the current trace context; await the result for the ack."""
    return await producer.send(topic, record.encode(), key=key.encode(), headers=inject_headers())


Outgoing = tuple[str, bytes, bytes | None, list[tuple[str, bytes]]]
"""One record to produce: ``(topic, value, key, headers)``."""

_PARTITIONER = DefaultPartitioner()


async def produce_all(producer: AIOKafkaProducer, records: Sequence[Outgoing]) -> list[BaseException | None]:
    """Produce ``records`` and wait for every ack; returns, per record, ``None`` (acknowledged) or the
    permanent error that refused it (one of :data:`PERMANENT_PRODUCE_ERRORS`).

    The records are packed into aiokafka batches here, one open ``BatchBuilder`` per partition (the partition
    that ``producer.send`` would pick: the default murmur2 partitioner over the topic's partitions), and queued
    with ``send_batch``: about 8 µs of CPU per record against 25 µs for one ``send`` each (measured on this
    machine against the embedded broker). Records keep their order within a partition. A record over the
    producer's ``max_request_size`` is refused with ``MessageSizeTooLargeError`` without being sent; when the
    broker refuses a batch permanently, its records are sent again one by one so that only the offending
    ones are reported.

    Raises:
        aiokafka.errors.KafkaError: a transient failure (broker away, timeout): the caller must not commit.
    """
    errors: list[BaseException | None] = [None] * len(records)
    limit = getattr(producer, "_max_request_size", None)
    partitions: dict[str, list[int]] = {}
    by_key: dict[tuple[str, bytes], int] = {}
    open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
    queued: list[tuple[asyncio.Future, list[int]]] = []

    async def flush(topic: str, partition: int) -> None:
        batch, idx = open_batches.pop((topic, partition))
        queued.append((await producer.send_batch(batch, topic, partition=partition), idx))

    for i, (topic, value, key, headers) in enumerate(records):
        if limit is not None and (n := record_size(value, key, headers)) > limit:
            errors[i] = kerr.MessageSizeTooLargeError(
                f"the message is {n} bytes when serialized, over max_request_size={limit}")
            continue
        if topic not in partitions:
            partitions[topic] = sorted(await producer.partitions_for(topic))
        parts = partitions[topic]
        if key is None:
            partition = parts[i % len(parts)]
        elif (partition := by_key.get((topic, key))) is None:  # murmur2 is pure Python: once per key
            partition = by_key[(topic, key)] = _PARTITIONER(key, parts, parts)
        entry = open_batches.get((topic, partition))
        if entry is not None and entry[0].append(key=key, value=value, timestamp=None, headers=headers) is not None:
            entry[1].append(i)
            continue
        if entry is not None:  # full: queue it and start the next one
            await flush(topic, partition)
        batch = producer.create_batch()
        batch.append(key=key, value=value, timestamp=None, headers=headers)  # an empty batch takes any record
        open_batches[(topic, partition)] = (batch, [i])
    for topic, partition in list(open_batches):
        await flush(topic, partition)
    for fut, idx in queued:
        try:
            await fut
        except PERMANENT_PRODUCE_ERRORS as e:
            if len(idx) == 1:
                errors[idx[0]] = e
                continue
            for j in idx:  # which of them? one by one
                topic, value, key, headers = records[j]
                try:
                    await (await producer.send(topic, value, key=key, headers=headers))
                except PERMANENT_PRODUCE_ERRORS as e1:
                    errors[j] = e1
    return errors


DLQ_PAYLOAD_CHARS = 65536
"""Characters of the original value a dead letter keeps at most (``DeadLetter.payload``)."""


async def dead_letter(producer: AIOKafkaProducer, msg: ConsumerRecord, consumer: str, reason: str) -> None:
    """Send ``msg`` (a record this consumer cannot process) to flywheel.dlq with ``reason`` and wait for
    the ack.

    The payload is the original value decoded as UTF-8 with replacement, cut to
    :data:`DLQ_PAYLOAD_CHARS` characters and, when the dead letter would still not fit the producer's
    ``max_request_size``, cut further (down to nothing) so the dead letter itself is never refused for
    its size.

    Raises:
        aiokafka.errors.KafkaError: the dead letter was not acknowledged (the caller must not commit).
    """
    payload = (msg.value or b"")[:DLQ_PAYLOAD_CHARS].decode("utf-8", errors="replace")
    key = (msg.key or b"").decode("utf-8", errors="replace") or "none"
    limit = getattr(producer, "_max_request_size", None)
    while True:
        dl = DeadLetter(
            source_topic=msg.topic, partition=msg.partition, offset=msg.offset, consumer=consumer,
            reason=reason[:2000], payload=payload,
        )
        if limit is None or not payload or record_size(dl.encode(), key) <= limit:
            break
        payload = payload[: len(payload) // 4]
    await (await send(producer, topics.DLQ, dl, key))
    log.warning("dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)


def record_size(value: bytes, key: str | bytes | None, headers=None) -> int:
    """Bytes aiokafka counts for one record against ``max_request_size`` (before compression; its own
    estimate, ``DefaultRecordBatchBuilder.estimate_size_in_bytes``)."""
    k = key.encode() if isinstance(key, str) else key
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(k, value, headers if headers is not None else [])


PERMANENT_PRODUCE_ERRORS: tuple[type[BaseException], ...] = (
    kerr.MessageSizeTooLargeError,  # client side (max_request_size) or the broker's message.max.bytes (10)
    kerr.RecordListTooLargeError,  # 18
    kerr.RecordTooLargeError,
    kerr.CorruptRecordException,  # 2: the broker refused the record (also InvalidRecord on Apache Kafka)
    kerr.InvalidTopicError,  # 17
    kerr.InvalidTimestampError,  # 32
    kerr.UnsupportedForMessageFormatError,  # 43
    kerr.PolicyViolationError,  # 44
)
"""Produce failures that no retry can cure: the record itself is refused (Kafka protocol error codes in
the comments). A consumer dead-letters the source record on these (the verifier's ``_produce_batch``,
the rollout's ``emit``); every other
error (the broker down, a timeout, a leader moving) is transient and raised for the caller to retry."""

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


def unproducible_trajectory(traj: Trajectory, reason: str) -> Trajectory:
    """A small stand-in for a trajectory whose record (or scored result) cannot be produced: the same ids,
    task and policy versions, no prompt ids, completion, turns or attestation, ``finish_reason="error"`` and
    ``error=reason``. Downstream it is what a failed generation is: the verifier scores it as an
    infrastructure error and the trainer drops its group as ``failed`` (``GroupDropped``), so the
    scheduler gives the group's slot back at once instead of waiting for its deadline."""
    return traj.model_copy(update={
        "prompt_ids": [], "completion_ids": [], "completion_logprobs": [], "loss_mask": [], "completion_text": "",
        "turns": [], "attestation": None, "finish_reason": "error", "error": reason[:2000]})


class BrokerLost(Exception):
    """Raised by :meth:`BrokerWatch.check` (and :meth:`BrokerWatch.guard`) once the broker went away after
    the session began: the session's clients must be rebuilt."""


async def decode_or_dead_letter(
    producer: AIOKafkaProducer, msg: ConsumerRecord, cls: type[R], consumer: str
) -> R | None:
    """Decode ``msg`` as ``cls``; on failure dead-letter it and return None (the caller moves on)."""
    try:
        return decode(msg.value, cls)
    except DecodeError as e:
        await dead_letter(producer, msg, consumer, e.reason)
        return None


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
    its unsent batches); errors are logged, never raised."""
    for c in clients:
        if c is None:
            continue
        try:
            await asyncio.wait_for(c.stop(), timeout_s)
        except asyncio.CancelledError:
            # aiokafka's consumer re-raises the cancellation of its own coordinator task when the broker is
            # gone; only a cancellation of the caller itself may propagate
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            log.info("closing %s: cancelled inside aiokafka", type(c).__name__)
        except Exception as e:  # noqa: BLE001 - closing after a failure; best effort
            log.info("closing %s: %r", type(c).__name__, e)


async def commit_batch(consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
    """Commit ``last.offset + 1`` for every partition of a ``getmany`` batch."""
    offsets = {tp: msgs[-1].offset + 1 for tp, msgs in batch.items() if msgs}
    if offsets:
        await consumer.commit(offsets)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``; loops check it between batches."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


def prepare_service(name: str, config, stop: asyncio.Event | None):
    """Common start of a Kafka service: logging to ``<run dir>/logs/<name>.log``, tracing by
    ``config.telemetry`` (:func:`shared.telemetry.setup_tracing`; the service calls
    :func:`shared.telemetry.flush_tracing` on its way out), and a stop event (SIGTERM/SIGINT set it when
    the caller passes none). Returns ``(stop, tracer)``."""
    setup_logging(name, config.run.log_level, config.run.path("logs"))
    tracer = setup_tracing(name, config.telemetry, config.run)
    if stop is None:
        stop = asyncio.Event()
        install_stop_signals(stop)
    return stop, tracer


def _main() -> int:
    """``python -m shared.kafka``: create every topic of the system (``$FLYWHEEL_CONFIG`` and the environment's
    ``kafka`` section) and check their partition counts; exit 1 naming the short ones (compose's one-shot
    ``kafka-topics``, run before any service)."""
    from shared.config import Settings

    setup_logging("kafka-topics")
    cfg = Settings.load().kafka
    try:
        asyncio.run(ensure_topics(cfg, strict=True))
    except TopicLayoutError as e:
        log.error("%s", e)
        return 1
    log.info("%d topics on %s with their partition counts", len(topics.ALL), cfg.bootstrap_servers)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
