"""A rollout process outlives a broker kill -9 and an empty broker on the same port, and
still follows the trainer's new weight versions.

A real rollout process (``python -m rollout_service``, the tiny model) on its own embedded broker has read
versions 1 and 2 from flywheel.weights (its group-less consumer is at offset 2) when the broker is
killed with SIGKILL; an empty broker starts on the same port. Version 3 is announced there, at offset 0.
Before the fix the process kept its old position, never saw version 3 (measured: a group-less consumer
at position 5 never returned records 0..4 of the new topic), and a request needing version 3 waited
forever; now the service rebuilds its clients (reading flywheel.weights from its start again) and reads
the checkpoint store, so the request is generated with version 3 within a bound.
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
import torch

from flywheel.broker import EmbeddedBroker, free_port, stop_pid
from shared import kafka, topics
from shared.checkpoint import CheckpointStore
from shared.config import KafkaConfig
from shared.model import build_tiny_model, load_model
from shared.model_weights import snapshot_weights
from shared.schemas import RolloutRequest, SamplingParams, Task, Trajectory
from tests.verifier_service.test_broker_outage import _topic_partitions

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]  # kills the broker: the e2e tier

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 30.0
"""Seconds from the new broker listening to the post-restart request's trajectories."""
TASK = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "q"}], verifier={"kind": "regex", "pattern": "^a"})


def _version(store: CheckpointStore, model_dir: Path, v: int):
    """Write policy version ``v`` (the tiny model shifted by ``v``) to the store; returns its WeightUpdate."""
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * v)
    return store.save(snapshot_weights(model), str(model_dir), v, v, None)


async def _send(cfg: KafkaConfig, topic: str, record, key: str) -> None:
    p = kafka.make_producer(cfg)
    await p.start()
    try:
        await (await kafka.send(p, topic, record, key))
    finally:
        await p.stop()


def _request(group: str, min_version: int) -> RolloutRequest:
    return RolloutRequest(group_id=group, task=TASK, n=2, sampling=SamplingParams(max_new_tokens=3),
                          min_policy_version=min_version)


async def test_rollout_survives_a_broker_kill_and_loads_a_version_announced_after_the_restart(tmp_path, read_topic):
    model_dir = build_tiny_model(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    store = CheckpointStore(run_dir / "checkpoints")
    port = free_port()
    b = EmbeddedBroker.start(port=port)
    cfg = KafkaConfig(bootstrap_servers=b.bootstrap_servers, partitions=2)
    await kafka.ensure_topics(cfg)
    env = dict(os.environ, FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS=b.bootstrap_servers, FLYWHEEL_KAFKA__PARTITIONS="2",
               FLYWHEEL_RUN__DIR=str(run_dir), FLYWHEEL_MODEL__NAME=str(model_dir), FLYWHEEL_TELEMETRY__TRACES="off",
               FLYWHEEL_TELEMETRY__METRICS_PORT="0", PYTHONPATH=str(ROOT))
    env.pop("FLYWHEEL_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "rollout_service"], env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for v in (1, 2):  # the rollout's weights consumer reads offsets 0 and 1
            upd = _version(store, model_dir, v)
            await _send(cfg, topics.WEIGHTS, upd, upd.model)
        await _send(cfg, topics.ROLLOUT_REQUESTS, _request("before", 2), "before")
        before = await read_topic(cfg, topics.TRAJECTORIES, Trajectory, 2, timeout_s=90,
                                  keep=lambda t: t.group_id == "before")
        assert len(before) == 2 and all(t.behaviour_version == 2 for t in before)

        os.killpg(b.pid, signal.SIGKILL)
        b.process.wait(5)
        await asyncio.sleep(1.0)
        b = EmbeddedBroker.start(port=port)
        t_up = time.monotonic()
        assert await _topic_partitions(cfg, topics.ROLLOUT_REQUESTS, BOUND_S) == 2  # re-created by the service
        upd = _version(store, model_dir, 3)
        await _send(cfg, topics.WEIGHTS, upd, upd.model)  # offset 0 of the new, empty broker's topic
        await _send(cfg, topics.ROLLOUT_REQUESTS, _request("after", 3), "after")
        after = await read_topic(cfg, topics.TRAJECTORIES, Trajectory, 2, timeout_s=BOUND_S,
                                 keep=lambda t: t.group_id == "after")
        took = time.monotonic() - t_up
        print(f"\nrollout: broker back -> request needing the version announced after the restart served in "
              f"{took:.2f} s")
        assert proc.poll() is None, f"the rollout exited with {proc.returncode}"
        assert len(after) == 2 and all(t.behaviour_version == 3 for t in after), after
        assert took <= BOUND_S
        assert "broker unreachable, retrying" in (run_dir / "logs" / "rollout.log").read_text()
    finally:
        stop_pid(proc)
        b.stop()
