"""The trainer service against a real broker: redelivered samples never train twice, restarts resume."""

import asyncio

import pytest

from flywheel.broker import EmbeddedBroker
from flywheel.config import load_config
from shared import kafka, topics
from shared.model import build_tiny_model
from shared.schemas import Metrics, Reward, ScoredTrajectory, Task, Trajectory, WeightUpdate
from trainer_service.main import run

TASK = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "q"}],
            verifier={"kind": "regex", "pattern": "^a"})


def _scored(gid, i, reward, version=0):
    tr = Trajectory(trajectory_id=f"{gid}:1:{i}", group_id=gid, sample_index=i, group_size=2, task=TASK,
                    prompt_ids=[5, 6], completion_ids=[7, 8], completion_logprobs=[-4.0, -4.0], loss_mask=[1, 1],
                    completion_text="xy", finish_reason="stop",
                    policy_versions=[{"version": version, "start": 0, "end": 2}])
    return ScoredTrajectory(trajectory=tr, reward=Reward(total=reward))


async def _produce(cfg, records):
    p = kafka.make_producer(cfg)
    await p.start()
    try:
        for r in records:
            await (await kafka.send(p, topics.SCORED, r, r.trajectory.group_id))
    finally:
        await p.stop()


@pytest.fixture
def setup(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with EmbeddedBroker.start() as b:
        cfg = load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run")},
                          kafka={"bootstrap_servers": b.bootstrap_servers, "partitions": 2},
                          budget={"batch_groups": 1, "max_steps": 10}, trainer={"lr": 1e-3})
        yield cfg


async def _with_trainer(cfg, body):
    stop = asyncio.Event()
    task = asyncio.create_task(run(cfg, stop))
    try:
        await body()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.mark.kafka
async def test_redelivered_trajectories_are_not_trained_twice_even_after_restart(setup, read_topic):
    cfg = setup
    g1 = [_scored("g1", 0, 1.0), _scored("g1", 1, 0.0)]

    async def first():
        await _produce(cfg.kafka, g1)
        assert [w.version for w in await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 1)] == [1]
        await _produce(cfg.kafka, g1)  # redelivery of an already trained group
        await _produce(cfg.kafka, [_scored("g2", 0, 0.0), _scored("g2", 1, 1.0)])
        ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 2)
        assert [w.version for w in ws] == [1, 2]

    await _with_trainer(cfg, first)
    metrics = await read_topic(cfg.kafka, topics.METRICS, Metrics, 2)
    assert metrics[-1].values["train/trained_groups_total"] == 2.0
    assert metrics[-1].values["train/duplicates_skipped_total"] == 2.0

    async def after_restart():
        # the restarted trainer resumes at version 2 and re-announces it; g1 again trains nothing
        await _produce(cfg.kafka, g1)
        await asyncio.sleep(3)
        ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 3, timeout_s=10)
        assert [w.version for w in ws] == [1, 2, 2]

    await _with_trainer(cfg, after_restart)
    assert len(await read_topic(cfg.kafka, topics.METRICS, Metrics, 3, timeout_s=5)) == 2


@pytest.mark.kafka
async def test_kill_9_mid_run_resumes_from_the_checkpoint_and_trains_no_group_twice(setup, read_topic, tmp_path):
    """The trainer as a real process, SIGKILLed after two versions: the restarted one resumes at the newest
    published version and every group is trained exactly once across both lives."""
    import json
    import os
    import signal
    import subprocess
    import sys

    cfg = setup
    env = dict(os.environ, FLYWHEEL_MODEL__NAME=cfg.model.name, FLYWHEEL_RUN__DIR=str(cfg.run.dir),
               FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS=cfg.kafka.bootstrap_servers, FLYWHEEL_KAFKA__PARTITIONS="2",
               FLYWHEEL_BUDGET__BATCH_GROUPS="1", FLYWHEEL_BUDGET__MAX_STEPS="10", FLYWHEEL_TRAINER__LR="1e-3")
    env.pop("FLYWHEEL_CONFIG", None)

    def start():
        return subprocess.Popen([sys.executable, "-m", "trainer_service"], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "trainer.log", "a"))

    # g0, g1 sampled by the base policy; g2, g3 by version 2 (so they are fresh for the restarted trainer)
    groups = {f"g{k}": [_scored(f"g{k}", 0, 1.0, 2 * (k >= 2)), _scored(f"g{k}", 1, 0.0, 2 * (k >= 2))]
              for k in range(4)}
    proc = start()
    try:
        await _produce(cfg.kafka, groups["g0"] + groups["g1"])
        ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 2, timeout_s=90)
        assert [w.version for w in ws] == [1, 2]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        # redeliveries of trained groups, plus new ones, while no trainer runs
        await _produce(cfg.kafka, groups["g0"] + groups["g1"] + groups["g2"] + groups["g3"])
        proc = start()
        ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 5, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    versions = [w.version for w in ws]
    assert versions[:2] == [1, 2] and versions[-2:] == [3, 4], versions  # v2 re-announced on restart
    ckpt = cfg.run.path(cfg.run.checkpoint_dir)
    trained = [g for v in (3, 4) for g in json.loads((ckpt / f"v{v:06d}" / "trained_groups.json").read_text())]
    assert sorted(trained) == ["g2", "g3"]  # g0 and g1 were trained before the kill and never again
