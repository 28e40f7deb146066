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

The package's modules: :mod:`shared.kafka.clients` (connection settings, clients, topics, service start),
:mod:`shared.kafka.produce` (sending, batches, dead letters) and :mod:`shared.kafka.broker` (the broker
watch and rebuilding a session). Import the names from ``shared.kafka``; ``python -m shared.kafka`` creates
the topics (:mod:`shared.kafka.__main__`).
"""

from __future__ import annotations

from shared.kafka.broker import (
    BROKER_ERRORS,
    BrokerLost,
    BrokerWatch,
    reconnect_pause,
    stop_clients,
    unless_set,
)
from shared.kafka.clients import (
    TopicLayoutError,
    client_options,
    commit_batch,
    ensure_topics,
    install_stop_signals,
    make_admin,
    make_consumer,
    make_producer,
    prepare_service,
)
from shared.kafka.produce import (
    DLQ_PAYLOAD_CHARS,
    PERMANENT_PRODUCE_ERRORS,
    Outgoing,
    dead_letter,
    decode_or_dead_letter,
    produce_all,
    record_size,
    send,
    unproducible_trajectory,
)

__all__ = [
    "BROKER_ERRORS", "DLQ_PAYLOAD_CHARS", "PERMANENT_PRODUCE_ERRORS", "BrokerLost", "BrokerWatch", "Outgoing",
    "TopicLayoutError", "client_options", "commit_batch", "dead_letter", "decode_or_dead_letter", "ensure_topics",
    "install_stop_signals", "make_admin", "make_consumer", "make_producer", "prepare_service", "produce_all",
    "reconnect_pause", "record_size", "send", "stop_clients", "unless_set", "unproducible_trajectory",
]
