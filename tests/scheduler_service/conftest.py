"""Fixtures of the scheduler tests: a config factory and a running app (REST client + state)."""

from __future__ import annotations

import itertools
import os
import signal
from contextlib import asynccontextmanager

import httpx
import pytest

from flywheel.broker import EmbeddedBroker
from flywheel.config import FlywheelConfig
from scheduler_service.api import create_app
from scheduler_service.config import SchedulerConfig
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared.auth import auth_headers
from shared.config import BudgetConfig, KafkaConfig, RunConfig


@pytest.fixture
def make_config(tmp_path):
    """Build a FlywheelConfig whose run directory is ``tmp_path``; sections as keyword dicts."""

    def build(kafka: KafkaConfig | None = None, scheduler: dict | None = None, budget: dict | None = None):
        return FlywheelConfig(
            kafka=kafka or KafkaConfig(),
            run=RunConfig(dir=str(tmp_path)),
            scheduler=SchedulerConfig(**(scheduler or {})),
            budget=BudgetConfig(**(budget or {})),
        )

    return build


@pytest.fixture
def running():
    """``async with running(config, kafka=...) as (client, state)``: app started, closed on exit; the client
    sends the app's bearer token (``client.headers``; drop it to test the 401s)."""

    @asynccontextmanager
    async def run(config: FlywheelConfig, kafka: bool = True):
        registry = Registry.from_url(config.scheduler.database_url, config.run)
        state = SchedulerState(config, registry, kafka=kafka)
        app = create_app(config, state)
        try:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://scheduler",
                                             headers=auth_headers(getattr(app.state, "auth_token", None))) as client:
                    yield client, state
        finally:
            registry.close()

    return run


@pytest.fixture
def private_broker(tmp_path):
    """``(broker, restart)``: a Tansu of this test only; ``restart()`` kills it with -9 and starts an empty one on
    the same port, returning the new one. Everything is stopped by pid at the end."""
    live = [EmbeddedBroker.start(log_path=tmp_path / "broker.log")]

    def restart() -> EmbeddedBroker:
        old = live[-1]
        if old.process.poll() is None:
            os.kill(old.pid, signal.SIGKILL)
            old.process.wait(10)
        live.append(EmbeddedBroker.start(port=old.port, log_path=tmp_path / "broker.log"))
        return live[-1]

    try:
        yield live[0], restart
    finally:
        for b in live:
            b.stop()


_SEQ = itertools.count()


def task_body(task_id: str | None = None, **kw) -> dict:
    """A valid TaskCreate body (regex verifier, K = 2). The prompt names ``task_id`` (or a fresh number), so
    bodies of distinct ids differ (the registry stores a task with another's content once, as a duplicate)."""
    body = {"domain": "toy", "prompt": [{"role": "user", "content": f"say a ({task_id or next(_SEQ)})"}],
            "verifier": {"kind": "regex", "pattern": "^a"}, "samples_per_task": 2}
    if task_id is not None:
        body["task_id"] = task_id
    body.update(kw)
    return body


@pytest.fixture
def task():
    """The :func:`task_body` factory."""
    return task_body


@pytest.fixture
async def kafka_io(kafka_cfg):
    """A started test producer plus a ``reader(topic)`` factory of group-less consumers (from earliest)."""
    from shared.kafka import ensure_topics, make_consumer, make_producer

    await ensure_topics(kafka_cfg)
    producer = make_producer(kafka_cfg, client_id="test")
    await producer.start()
    consumers = []

    async def reader(*topic_names: str):
        c = make_consumer(kafka_cfg, *topic_names, group_id=None, client_id="test-reader")
        await c.start()
        consumers.append(c)
        return c

    try:
        yield producer, reader
    finally:
        for c in consumers:
            await c.stop()
        await producer.stop()

