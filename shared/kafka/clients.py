"""Kafka clients and topics: the connection settings every client shares (:func:`client_options`, from
:class:`shared.config.KafkaConfig`, with the optional SASL/SSL security of an external Apache Kafka),
producers with acks=all, manual-commit consumers, topic creation with its partition check, and the common
start of a Kafka service.

The embedded broker has no idempotent producer and wrong "latest" offsets, so producers never enable
idempotence and consumers start from committed or earliest offsets (DESIGN.md, "Delivery semantics").
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Iterable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from shared import topics
from shared.config import KafkaConfig
from shared.telemetry import setup_logging, setup_tracing

log = logging.getLogger("shared.kafka")


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
