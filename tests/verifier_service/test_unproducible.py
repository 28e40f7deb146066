"""A trajectory whose scored result cannot be produced must not crash-loop the verifier.

A real verifier process (``python -m verifier_service``) on its own embedded broker, with a small
``kafka.max_request_size`` (20,000 bytes) standing in for the 16 MiB limit: a trajectory of highly
compressible text and tokens fetches fine (its lz4 batch is small) but its ScoredTrajectory is over the limit
uncompressed, which is what aiokafka checks. Before the fix the process exited with
``MessageSizeTooLargeError`` before committing, and the record came back after every restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from flywheel.broker import EmbeddedBroker, free_port, stop_pid
from shared import kafka, topics
from shared.config import KafkaConfig
from shared.metrics import scrape, total
from shared.schemas import DeadLetter, RewardEvent, ScoredTrajectory, Task, Trajectory

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 20_000


def _traj(tag: str, i: int, text: str, tokens: int = 1) -> Trajectory:
    task = Task(task_id=f"task-{tag}-{i}", domain="toy", prompt=[{"role": "user", "content": "say a"}],
                verifier={"kind": "regex", "pattern": "^a"})
    return Trajectory(
        trajectory_id=f"{tag}:{i}", group_id=f"g-{tag}", sample_index=i, group_size=2, task=task,
        prompt_ids=[1, 2], completion_ids=[3] * tokens, completion_logprobs=[-0.1] * tokens, loss_mask=[1] * tokens,
        completion_text=text, finish_reason="stop", policy_versions=[{"version": 0, "start": 0, "end": tokens}])


def start_verifier(bootstrap: str, run_dir: Path, group: str, metrics_port: int, **env: str) -> subprocess.Popen:
    """``python -m verifier_service`` on ``bootstrap`` (its own session, stopped by pid), logging under ``run_dir``."""
    e = dict(os.environ, FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS=bootstrap, FLYWHEEL_KAFKA__PARTITIONS="2",
             FLYWHEEL_RUN__DIR=str(run_dir), FLYWHEEL_TELEMETRY__TRACES="off",
             FLYWHEEL_TELEMETRY__METRICS_PORT=str(metrics_port), FLYWHEEL_VERIFIER__CONSUMER_GROUP=group,
             PYTHONPATH=str(ROOT), **env)
    e.pop("FLYWHEEL_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "verifier_service"], env=e, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_an_unproducible_scored_result_is_dead_lettered_committed_and_the_next_record_scored(
        tmp_path, read_topic):
    tag = f"big{time.time_ns() % 10**8}"
    with EmbeddedBroker.start() as b:
        cfg = KafkaConfig(bootstrap_servers=b.bootstrap_servers, partitions=2)
        await kafka.ensure_topics(cfg)
        port = free_port()
        proc = start_verifier(b.bootstrap_servers, tmp_path / "run", f"verifier-{tag}", port,
                              FLYWHEEL_KAFKA__MAX_REQUEST_SIZE=str(LIMIT))
        producer = kafka.make_producer(cfg)  # the test's producer keeps the 16 MiB limit
        await producer.start()
        try:
            # ~30 KB uncompressed, a few hundred bytes in lz4; the lean scored record carries the
            # token ids, log-probs and mask, not the text: 3,000 tokens make it over the limit too
            big = _traj(tag, 0, "a" + "b" * 30_000, tokens=3_000)
            small = _traj(tag, 1, "abc")
            assert kafka.record_size(big.encode(), big.group_id) > LIMIT
            for t in (big, small):  # same key: same partition, the big one first
                await (await kafka.send(producer, topics.TRAJECTORIES, t, t.group_id))

            dead = await read_topic(cfg, topics.DLQ, DeadLetter, 1, timeout_s=60, keep=lambda r: tag in r.payload)
            scored = await read_topic(cfg, topics.SCORED, ScoredTrajectory, 2, timeout_s=30,
                                      keep=lambda r: r.trajectory.group_id == big.group_id)
            events = await read_topic(cfg, topics.REWARDS, RewardEvent, 2, timeout_s=30,
                                      keep=lambda r: r.group_id == big.group_id)
            assert proc.poll() is None, f"the verifier exited with {proc.returncode}"

            # the dead letter names the error, the topic it could not be produced to and the size
            assert len(dead) == 1, dead
            d = dead[0]
            assert d.source_topic == topics.TRAJECTORIES and d.consumer == "verifier"
            assert "MessageSizeTooLargeError" in d.reason and topics.SCORED in d.reason
            assert str(LIMIT) in d.reason and "bytes" in d.reason
            assert len(d.payload) < LIMIT  # truncated so the dead letter itself fits

            # the next record is scored; the unproducible one reaches the trainer as a failed sample
            by_id = {s.trajectory.trajectory_id: s for s in scored}
            assert by_id[small.trajectory_id].reward.total == 1.0
            stand_in = by_id[big.trajectory_id]
            assert stand_in.reward.infra_error and stand_in.trajectory.finish_reason == "error"
            assert stand_in.trajectory.completion_ids == []  # the reason is on its RewardEvent (below)
            ev = {e.trajectory_id: e for e in events}
            assert ev[big.trajectory_id].infra_error and "MessageSizeTooLargeError" in ev[big.trajectory_id].reason
            assert ev[small.trajectory_id].passed

            # committed past both (the group's offset on that partition is beyond the big record)
            deadline = time.monotonic() + 20
            committed = None
            while time.monotonic() < deadline:
                probe = AIOKafkaConsumer(bootstrap_servers=b.bootstrap_servers, group_id=f"verifier-{tag}",
                                         enable_auto_commit=False)
                await probe.start()
                try:
                    offs = [await probe.committed(TopicPartition(topics.TRAJECTORIES, p)) for p in (0, 1)]
                finally:
                    await probe.stop()
                committed = sum(o or 0 for o in offs)
                if committed >= 2:
                    break
                await asyncio.sleep(0.5)
            assert committed == 2, committed

            # counted in the verifier's DLQ metric
            prom = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
            assert total(prom, "flywheel_verifier_dlq_records_total",
                         lambda lab: lab["topic"] == topics.TRAJECTORIES) == 1
        finally:
            await producer.stop()
            stop_pid(proc)
