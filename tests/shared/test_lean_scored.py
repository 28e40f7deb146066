"""The flywheel.scored v3 record carries what the trainer trains on; a v2 record still decodes (tolerant)."""

from __future__ import annotations

import orjson

from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory, TrainSample, decode
from verifier_service.intake import TrajectoryDecoder


def _traj(i: int = 0) -> Trajectory:
    task = Task(task_id="t1", domain="code", prompt=[{"role": "user", "content": "write f"}],
                verifier={"kind": "unit_tests", "tests": "assert f() == 1\n" * 50, "entry_point": "f"})
    return Trajectory(trajectory_id=f"g:1:{i}", group_id="g", sample_index=i, group_size=2, task=task,
                      prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-0.5, -0.25], loss_mask=[1, 0],
                      completion_text="def f(): return 1", finish_reason="stop", temperature=0.7,
                      policy_versions=[{"version": 2, "start": 0, "end": 2}])


def test_the_scored_record_holds_no_task_and_keeps_what_the_trainer_reads():
    tr = _traj()
    rec = ScoredTrajectory.of(tr, Reward(total=1.0, components={"correctness": 1.0}, details={"x": 1}))
    raw = rec.encode()
    assert b"assert f()" not in raw and b"completion_text" not in raw and b"components" not in raw
    back = decode(raw, ScoredTrajectory)
    s = back.trajectory
    assert (s.task_id, s.domain, s.prompt_ids, s.completion_ids, s.loss_mask, s.temperature) == (
        "t1", "code", [1, 2], [3, 4], [1, 0], 0.7)
    assert s.behaviour_version == 2 and back.reward.passed and back.schema_version == 3
    assert ScoredTrajectory(trajectory=tr, reward=Reward(total=1.0)).encode() == raw  # built from the full records


def test_a_version_2_record_decodes_to_its_lean_part():
    tr = _traj()
    v2 = {"schema": "flywheel.ScoredTrajectory", "schema_version": 2, "trajectory": tr.model_dump(mode="json"),
          "reward": Reward(total=0.0, infra_error=True, details={"reason": "down"}).model_dump(mode="json")}
    back = decode(orjson.dumps(v2), ScoredTrajectory)
    assert back.trajectory == TrainSample.of(tr) and back.reward.infra_error and not back.reward.passed


def test_the_verifier_validates_a_groups_task_once_and_decodes_like_the_generic_path():
    dec = TrajectoryDecoder()
    raws = [_traj(i).encode() for i in range(2)]
    got = [dec.decode(r) for r in raws]
    assert got == [decode(r, Trajectory) for r in raws] and dec.hits == 1 and got[0].task is got[1].task
