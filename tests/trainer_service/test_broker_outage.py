"""A trainer process outlives a broker kill -9 and an empty broker on the same port.

A real trainer (``python -m trainer_service``, the tiny model, one group per step) has published version 1
when the broker is killed with SIGKILL; an empty broker starts on the same port. The trainer must stay
up, re-announce its newest version on the new broker (the rollout engines and the scheduler read it from
there) and train a group produced after the restart. Before the fix the process exited (its clients'
errors, or a cancelled close, ended ``run``).

It must also forget the old broker's offsets: on one partition the old broker's records reached offset 6 and
the new broker's only 2, so a commit above 2 on the new broker (found by the chaos test: a rebuilt session
kept the old read positions, committed past records it had not read, and the next trainer process skipped
them) fails the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.broker import EmbeddedBroker, free_port, stop_pid
from shared import kafka, topics
from shared.config import KafkaConfig
from shared.model import build_tiny_model
from shared.schemas import WeightUpdate
from tests.trainer_service.test_trainer_service import _produce, _scored

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]  # kills the broker: the e2e tier

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 30.0
"""Seconds from the new broker listening to the version trained on a post-restart group."""


async def _committed(cfg: KafkaConfig, group: str, at_least: int, wait_s: float = 15.0) -> dict:
    """The consumer group's committed offsets on flywheel.scored partition 0, once one is ``at_least`` (or after
    ``wait_s`` seconds)."""
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    parts = [TopicPartition(topics.SCORED, 0)]
    await admin.start()
    try:
        deadline = time.monotonic() + wait_s
        while True:
            offsets = {tp.partition: m.offset for tp, m in (await admin.list_consumer_group_offsets(group, partitions=parts)).items()
                       if tp.topic == topics.SCORED and m.offset >= 0}
            if any(o >= at_least for o in offsets.values()) or time.monotonic() > deadline:
                return offsets
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def test_trainer_survives_a_broker_kill_reannounces_and_trains_again(tmp_path, read_topic):
    model = build_tiny_model(tmp_path / "tiny")
    port = free_port()
    b = EmbeddedBroker.start(port=port)
    cfg = KafkaConfig(bootstrap_servers=b.bootstrap_servers, partitions=1)  # one partition: offsets comparable
    await kafka.ensure_topics(cfg)
    env = dict(os.environ, FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS=b.bootstrap_servers, FLYWHEEL_KAFKA__PARTITIONS="1",
               FLYWHEEL_RUN__DIR=str(tmp_path / "run"), FLYWHEEL_MODEL__NAME=str(model),
               FLYWHEEL_TELEMETRY__TRACES="off", FLYWHEEL_BUDGET__BATCH_GROUPS="1", FLYWHEEL_BUDGET__MAX_STEPS="10",
               FLYWHEEL_BUDGET__MAX_STALENESS="5", PYTHONPATH=str(ROOT))
    env.pop("FLYWHEEL_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainer_service"], env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # offsets 0..5 on the old broker: the group, then four redeliveries the trainer skips
        await _produce(cfg, [_scored("g1", 0, 1.0), _scored("g1", 1, 0.0)] * 3)
        assert await read_topic(cfg, topics.WEIGHTS, WeightUpdate, 1, timeout_s=90, keep=lambda u: u.version == 1)

        os.killpg(b.pid, signal.SIGKILL)
        b.process.wait(5)
        await asyncio.sleep(1.0)
        b = EmbeddedBroker.start(port=port)
        t_up = time.monotonic()
        again = await read_topic(cfg, topics.WEIGHTS, WeightUpdate, 1, timeout_s=BOUND_S, keep=lambda u: u.version == 1)
        reannounced = time.monotonic() - t_up
        assert again, "version 1 was not announced again on the new broker"
        await _produce(cfg, [_scored("g2", 0, 1.0, 1), _scored("g2", 1, 0.0, 1)])
        v2 = await read_topic(cfg, topics.WEIGHTS, WeightUpdate, 1, timeout_s=BOUND_S, keep=lambda u: u.version == 2)
        took = time.monotonic() - t_up
        print(f"\ntrainer: broker back -> version 1 re-announced in {reannounced:.2f} s, version 2 (a group produced "
              f"after the restart) in {took:.2f} s")
        assert proc.poll() is None, f"the trainer exited with {proc.returncode}"
        assert v2 and took <= BOUND_S
        committed = await _committed(cfg, "trainer", at_least=2)
        assert committed and all(o <= 2 for o in committed.values()), f"committed past the new broker's 2 records: {committed}"
        assert "broker unreachable, retrying" in (tmp_path / "run" / "logs" / "trainer.log").read_text()
    finally:
        stop_pid(proc)
        b.stop()
