"""Fixtures shared by every test: the real embedded broker and a Kafka config pointing at it."""

from __future__ import annotations

import uuid

import pytest

from shared.broker import EmbeddedBroker
from shared.config import KafkaConfig


@pytest.fixture(scope="session")
def broker():
    """One Tansu broker (memory storage, free loopback port) for the session, stopped by pid at the end."""
    b = EmbeddedBroker.start()
    try:
        yield b
    finally:
        b.stop()
    assert b.process.poll() is not None


@pytest.fixture
def kafka_cfg(broker) -> KafkaConfig:
    """Kafka settings for the session broker (2 partitions to keep tests quick)."""
    return KafkaConfig(bootstrap_servers=broker.bootstrap_servers, partitions=2)


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic names, consumer groups and ids, so tests never share state."""
    return uuid.uuid4().hex[:8]
