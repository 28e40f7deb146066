"""aiokafka helpers: producers with acks=all, manual-commit consumers, topic creation, dead letters.

The delivery contract (DESIGN.md, "Delivery semantics") is at-least-once: a consumer commits an
offset only after everything it produced for that record is acknowledged. The embedded broker
has no idempotent producer and wrong "latest" offsets, so producers never enable idempotence and
consumers start from committed or earliest offsets.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Iterable, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from shared import topics
from shared.config import KafkaConfig
from shared.schemas import DeadLetter, DecodeError, Record, decode
from shared.telemetry import inject_headers, setup_logging, setup_tracing

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)


def make_producer(cfg: KafkaConfig, client_id: str = "flywheel") -> AIOKafkaProducer:
    """A producer that waits for acks from all in-sync replicas (not started)."""
    return AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap_servers,
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
    ``latest``; not started).

    With ``group_id=None`` the consumer has no group and no commits (e.g. every rollout replica
    reading every weight version).
    """
    return AIOKafkaConsumer(
        *topic_names,
        bootstrap_servers=cfg.bootstrap_servers,
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


async def ensure_topics(cfg: KafkaConfig, names: Iterable[str] = topics.ALL) -> None:
    """Create the topics that do not exist yet, with the partition counts of ``shared.topics``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
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
    finally:
        await admin.close()


async def send(producer: AIOKafkaProducer, topic: str, record: Record, key: str) -> asyncio.Future:
    """Queue ``record`` on ``topic`` with the current trace context; await the result for the ack."""
    return await producer.send(topic, record.encode(), key=key.encode(), headers=inject_headers())


async def dead_letter(producer: AIOKafkaProducer, msg: ConsumerRecord, consumer: str, reason: str) -> None:
    """Send a malformed record to flywheel.dlq with ``reason`` and wait for the ack."""
    payload = (msg.value or b"")[:65536].decode("utf-8", errors="replace")
    dl = DeadLetter(
        source_topic=msg.topic, partition=msg.partition, offset=msg.offset, consumer=consumer, reason=reason,
        payload=payload,
    )
    key = (msg.key or b"").decode("utf-8", errors="replace") or "none"
    await (await send(producer, topics.DLQ, dl, key))
    log.warning("dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)


async def decode_or_dead_letter(
    producer: AIOKafkaProducer, msg: ConsumerRecord, cls: type[R], consumer: str
) -> R | None:
    """Decode ``msg`` as ``cls``; on failure dead-letter it and return None (the caller moves on)."""
    try:
        return decode(msg.value, cls)
    except DecodeError as e:
        await dead_letter(producer, msg, consumer, e.reason)
        return None


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
