"""The trainer's Prometheus metrics on its metrics port, against a real broker and the tiny model: a
step's phases, samples by domain, staleness, a failed group's drop and a malformed record's dead letter."""

import asyncio
import time

import httpx
import pytest

from flywheel.broker import EmbeddedBroker, free_port
from flywheel.config import load_config
from shared import kafka, topics
from shared.metrics import scrape, total
from shared.model import build_tiny_model
from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory
from trainer_service.main import run
from trainer_service.metrics import PHASES


def _scored(gid: str, i: int, reward: float, domain: str, infra: bool = False) -> ScoredTrajectory:
    task = Task(task_id=f"t-{gid}", domain=domain, prompt=[{"role": "user", "content": "q"}],
                verifier={"kind": "regex", "pattern": "^a"})
    tr = Trajectory(trajectory_id=f"{gid}:1:{i}", group_id=gid, sample_index=i, group_size=2, task=task,
                    prompt_ids=[5, 6], completion_ids=[7, 8], completion_logprobs=[-4.0, -4.0], loss_mask=[1, 1],
                    completion_text="xy", finish_reason="stop", policy_versions=[{"version": 0, "start": 0, "end": 2}])
    return ScoredTrajectory(trajectory=tr, reward=Reward(total=reward, infra_error=infra))


@pytest.mark.kafka
async def test_trainer_metrics_count_steps_phases_domains_drops_and_dead_letters(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    port = free_port()
    with EmbeddedBroker.start() as b:
        cfg = load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run")},
                          kafka={"bootstrap_servers": b.bootstrap_servers, "partitions": 2},
                          budget={"batch_groups": 2, "max_steps": 10}, trainer={"lr": 1e-3},
                          telemetry={"metrics_port": port})
        stop = asyncio.Event()
        task = asyncio.create_task(run(cfg, stop))
        p = kafka.make_producer(cfg.kafka)
        await p.start()
        try:
            records = [_scored("a", 0, 1.0, "toy"), _scored("a", 1, 0.0, "toy"),
                       _scored("b", 0, 1.0, "code"), _scored("b", 1, 0.0, "code"),
                       _scored("c", 0, 1.0, "code"), _scored("c", 1, 0.0, "code", infra=True)]
            for r in records:
                await (await kafka.send(p, topics.SCORED, r, r.trajectory.group_id))
            await p.send_and_wait(topics.SCORED, b"{not a record", key=b"junk")
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 120
            while True:
                try:
                    m = await asyncio.to_thread(scrape, url)
                except httpx.ConnectError:  # the model is still loading: no server yet
                    m = {}
                if total(m, "flywheel_trainer_steps_total") >= 1 and total(m, "flywheel_trainer_dlq_records_total"):
                    break
                assert time.monotonic() < deadline, m.get("flywheel_trainer_steps_total")
                await asyncio.sleep(0.5)
        finally:
            await p.stop()
            stop.set()
            await asyncio.wait_for(task, 30)
    assert total(m, "flywheel_trainer_steps_total") == 1
    assert m["flywheel_trainer_policy_version"] == [({}, 1.0)]
    phases = {lab["phase"] for lab, v in m["flywheel_trainer_phase_seconds_count"] if v == 1}
    assert phases == set(PHASES.values()) - {"broadcast"}  # no broadcast with the checkpoint transport
    assert total(m, "flywheel_trainer_weight_publish_seconds_count") == 1
    assert {lab["domain"]: v for lab, v in m["flywheel_trainer_samples_trained_total"]} == {"toy": 2, "code": 2}
    assert {lab["domain"]: v for lab, v in m["flywheel_trainer_groups_trained_total"]} == {"toy": 1, "code": 1}
    assert total(m, "flywheel_trainer_staleness_versions_count") == 4
    assert total(m, "flywheel_trainer_staleness_versions_bucket", lambda lab: lab["le"] == "0.0") == 4
    assert m["flywheel_trainer_groups_dropped_total"] == [({"reason": "failed"}, 1.0)]
    assert m["flywheel_trainer_dlq_records_total"] == [({"topic": topics.SCORED}, 1.0)]
