"""A verifier process outlives a broker kill -9 and an empty broker on the same port.

A real verifier (``python -m verifier_service``) on its own embedded broker is scoring a trajectory (its
judge takes 4 s) when the broker is killed with SIGKILL; 1.5 s later an empty broker (memory storage:
no topics, no committed offsets) starts on the same port. The verifier must stay up, re-create its
topics with the configured partition count, re-join its group, and score a trajectory produced after the
restart within a bound. Before the fix the in-flight batch's produce failed and the process exited.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from flywheel.broker import EmbeddedBroker, free_port, stop_pid
from shared import kafka, topics
from shared.config import KafkaConfig
from shared.schemas import RewardEvent, Task, Trajectory
from tests.verifier_service.scripted_judge import ScriptedJudgeServer
from tests.verifier_service.test_unproducible import start_verifier

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]  # kills the broker: the e2e tier

BOUND_S = 30.0
"""Seconds from the new broker listening to the post-restart trajectory's reward (issue: ≤ 30 s for a broker kill)."""


def _traj(tag: str, i: int, judged: bool) -> Trajectory:
    spec = ({"kind": "regex", "pattern": "^a", "recipe": {"judge": {"rubric": "Says a."},
                                                          "weights": {"correctness": 1, "judge": 1}}}
            if judged else {"kind": "regex", "pattern": "^a"})
    task = Task(task_id=f"task-{tag}-{i}", domain="toy", prompt=[{"role": "user", "content": "say a"}], verifier=spec)
    return Trajectory(
        trajectory_id=f"{tag}:{i}", group_id=f"g-{tag}", sample_index=i, group_size=3, task=task,
        prompt_ids=[1], completion_ids=[3], completion_logprobs=[-0.1], loss_mask=[1], completion_text="abc",
        finish_reason="stop", policy_versions=[{"version": 0, "start": 0, "end": 1}])


async def _produce(cfg: KafkaConfig, t: Trajectory) -> None:
    p = kafka.make_producer(cfg)
    await p.start()
    try:
        await (await kafka.send(p, topics.TRAJECTORIES, t, t.group_id))
    finally:
        await p.stop()


async def _topic_partitions(cfg: KafkaConfig, topic: str, timeout_s: float) -> int | None:
    """The partition count of ``topic`` once it exists (None if it does not within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        admin = kafka.make_admin(cfg)
        try:
            await admin.start()
            if topic not in await admin.list_topics():  # (describing a missing topic would auto-create it)
                raise LookupError(topic)
            desc = await admin.describe_topics([topic])
            if desc and not desc[0].get("error_code") and desc[0].get("partitions"):
                return len(desc[0]["partitions"])
        except Exception:  # noqa: BLE001 - not there yet
            pass
        finally:
            await admin.close()
        await asyncio.sleep(0.2)
    return None


async def test_verifier_survives_a_broker_kill_and_an_empty_restart_on_the_same_port(tmp_path, read_topic):
    tag = f"out{time.time_ns() % 10**8}"
    slow = lambda _: (time.sleep(4), "SCORE: 9")[1]  # noqa: E731 - the judge is busy when the broker dies
    port = free_port()
    with ScriptedJudgeServer(slow) as judge:
        b = EmbeddedBroker.start(port=port)
        cfg = KafkaConfig(bootstrap_servers=b.bootstrap_servers, partitions=2)
        await kafka.ensure_topics(cfg)
        proc = start_verifier(b.bootstrap_servers, tmp_path / "run", f"verifier-{tag}", free_port(),
                              FLYWHEEL_VERIFIER__JUDGE__BASE_URL=judge, FLYWHEEL_VERIFIER__METRICS_INTERVAL_S="0.5")
        try:
            warm = _traj(tag, 0, judged=False)
            await _produce(cfg, warm)
            assert await read_topic(cfg, topics.REWARDS, RewardEvent, 1, timeout_s=60,
                                    keep=lambda r: r.trajectory_id == warm.trajectory_id)
            await _produce(cfg, _traj(tag, 1, judged=True))  # being judged when the broker dies
            await asyncio.sleep(1.0)
            os.killpg(b.pid, signal.SIGKILL)
            b.process.wait(5)
            await asyncio.sleep(1.5)
            b = EmbeddedBroker.start(port=port)
            t_up = time.monotonic()

            # the verifier re-creates its topics, with the configured partitions
            assert await _topic_partitions(cfg, topics.TRAJECTORIES, BOUND_S) == 2
            after = _traj(tag, 2, judged=False)  # same key as before the restart: same partition
            await _produce(cfg, after)
            got = await read_topic(cfg, topics.REWARDS, RewardEvent, 1, timeout_s=BOUND_S,
                                   keep=lambda r: r.trajectory_id == after.trajectory_id)
            took = time.monotonic() - t_up
            print(f"\nverifier: broker back -> post-restart trajectory scored in {took:.2f} s")
            assert proc.poll() is None, f"the verifier exited with {proc.returncode}"
            assert got and got[0].passed, "the trajectory produced after the restart was not scored"
            assert took <= BOUND_S
            log = (tmp_path / "run" / "logs" / "verifier.log").read_text()
            assert "broker unreachable, retrying" in log
        finally:
            stop_pid(proc)
            b.stop()
