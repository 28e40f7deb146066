import orjson
import pytest

from shared.schemas import DecodeError, RewardEvent, Task, Trajectory, decode


def _task(**kw):
    base = dict(task_id="t1", domain="toy", prompt=[{"role": "user", "content": "hi"}],
                verifier={"kind": "regex", "pattern": "^a"})
    base.update(kw)
    return Task(**base)


def test_task_round_trip_keeps_schema_and_discriminated_verifier():
    t = _task(verifier={"kind": "math", "answer": "1/2"}, metadata={"x": [1, 2]})
    obj = orjson.loads(t.encode())
    assert obj["schema"] == "flywheel.Task" and obj["schema_version"] == Task.VERSION == 3
    back = decode(t.encode(), Task)
    assert back == t and back.verifier.kind == "math"


def test_a_version_2_task_still_decodes_and_a_version_1_does_not():
    """Version 3 only added the ``environment`` verifier kind: every version-2 record is a valid version-3 one."""
    obj = orjson.loads(_task(verifier={"kind": "exact", "answer": "1"}).encode())
    assert decode(orjson.dumps({**obj, "schema_version": 2}), Task).schema_version == 3
    with pytest.raises(DecodeError, match="schema version 1"):
        decode(orjson.dumps({**obj, "schema_version": 1}), Task)


def test_trajectory_round_trip_and_alignment_check():
    t = _task()
    tr = Trajectory(trajectory_id="g:1:0", group_id="g", sample_index=0, group_size=2, task=t, prompt_ids=[1, 2],
                    completion_ids=[3, 4], completion_logprobs=[-0.1, -0.2], loss_mask=[1, 1], completion_text="ab",
                    finish_reason="stop", policy_versions=[{"version": 3, "start": 0, "end": 2}])
    assert decode(tr.encode(), Trajectory) == tr
    assert tr.behaviour_version == 3
    bad = orjson.loads(tr.encode())
    bad["loss_mask"] = [1]
    with pytest.raises(DecodeError, match="equal lengths"):
        decode(orjson.dumps(bad), Trajectory)


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"schema": "flywheel.Task", "schema_version": 2}', "task_id"),
        (b'{"schema": "flywheel.Other", "schema_version": 1}', "schema is"),
    ],
)
def test_decode_rejects_with_reason(raw, needle):
    with pytest.raises(DecodeError, match=needle):
        decode(raw, Task)


def test_wrong_schema_version_is_rejected():
    obj = orjson.loads(_task().encode())
    obj["schema_version"] = 99
    with pytest.raises(DecodeError, match="version 99"):
        decode(orjson.dumps(obj), Task)


def test_task_rejects_k_below_two_and_empty_prompt():
    with pytest.raises(ValueError, match="samples_per_task"):
        _task(samples_per_task=1)
    with pytest.raises(ValueError, match="prompt"):
        _task(prompt=[])
    with pytest.raises(ValueError, match="kind"):
        _task(verifier={"kind": "nope"})


def test_reward_event_rejects_wrong_schema_name():
    with pytest.raises(DecodeError):
        decode(_task().encode(), RewardEvent)


def test_group_dropped_round_trip_and_reason_is_checked():
    from shared.schemas import GroupDropped

    d = GroupDropped(group_id="t:0", reason="stale", policy_version=5, behaviour_version=3, samples=8)
    assert decode(d.encode(), GroupDropped) == d and orjson.loads(d.encode())["schema"] == "flywheel.GroupDropped"
    bad = orjson.loads(d.encode())
    bad["reason"] = "bored"
    with pytest.raises(DecodeError, match="reason"):
        decode(orjson.dumps(bad), GroupDropped)


def test_a_metrics_record_leaves_out_non_finite_values_so_it_still_decodes():
    from shared.schemas import Metrics, decode

    rec = Metrics(source="trainer", step=3, values={"loss/total": 0.5, "loss/kl": float("nan"),
                                                    "train/grad_norm": float("inf")})
    assert rec.values == {"loss/total": 0.5}
    assert decode(rec.encode(), Metrics).values == {"loss/total": 0.5}
