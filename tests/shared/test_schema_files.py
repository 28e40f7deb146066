"""The published topic schemas (docs/schemas/): up to date, valid for real records, compatible with the
committed ones."""

from __future__ import annotations

import json
import subprocess

import orjson
import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from shared import topics
from shared.schema_export import (
    SCHEMA_DIR,
    TOPIC_RECORDS,
    compatibility_problems,
    expected_files,
    lenient,
    topic_schema,
    write,
)
from shared.schemas import (
    Alert,
    Control,
    DeadLetter,
    DecodeError,
    GroupDropped,
    Metrics,
    Reward,
    RewardEvent,
    RolloutRequest,
    SamplingParams,
    ScoredTrajectory,
    Task,
    Trajectory,
    WeightUpdate,
    decode,
)

TASKS = [
    Task(task_id="t-regex", domain="toy", prompt=[{"role": "user", "content": "say a"}],
         verifier={"kind": "regex", "pattern": "^a"}, samples_per_task=4, difficulty=0.5,
         metadata={"x": [1, {"y": None}]}),
    Task(task_id="t-code", domain="code", split="eval", prompt=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "f(x) = x + 1"}],
         verifier={"kind": "unit_tests", "entry_point": "f", "tests": [{"name": "t0", "code": "assert f(1) == 2"}]},
         pool="cpu-pool", tools=["python"], max_turns=3),
    Task(task_id="t-math", domain="math", prompt=[{"role": "user", "content": "1/2 + 1/2?"}],
         verifier={"kind": "math", "answer": "1", "recipe": {"rules": [{"rule": "format", "answer_tag": True}],
                                                              "gates": ["format"]}}),
]


def _trajectory(task: Task, finish: str = "stop") -> Trajectory:
    return Trajectory(trajectory_id=f"{task.task_id}:g:1:0", group_id=f"{task.task_id}:g", sample_index=0,
                      group_size=task.samples_per_task, task=task, prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                      completion_logprobs=[-0.1, -2.5, -0.3], loss_mask=[1, 0, 1], completion_text="a = 1",
                      finish_reason=finish, policy_versions=[{"version": 2, "start": 0, "end": 1},
                                                             {"version": 3, "start": 1, "end": 3}],
                      timings={"queue": 0.1, "generate": 0.4}, cost={"generated_tokens": 2.0},
                      turns=[{"role": "assistant", "start": 0, "end": 3, "text": "a = 1"}])


def _samples() -> dict[str, list]:
    """A few records of each topic, filled beyond the defaults; rewards made by the verifier's own code."""
    from verifier_service.main import reward_event

    trajs = [_trajectory(t) for t in TASKS] + [_trajectory(TASKS[2], "length")]
    rewards = [Reward(total=1.0, components={"correctness": 1.0}, details={"extracted": "a"}),
               Reward(total=0.0, components={"correctness": 1.0, "format": 0.0},
                      details={"gated_by": ["format"], "hacks": {"multiple_answers": {"n": 2}}}),
               Reward(total=0.0, infra_error=True, details={"reason": "sandbox down", "misconfigured": False}),
               Reward(total=0.25, components={"correctness": 0.25})]
    return {
        topics.TASKS: TASKS,
        topics.ROLLOUT_REQUESTS: [RolloutRequest(group_id="g", task=t, n=t.samples_per_task, eval_round=1,
                                                 sampling=SamplingParams(max_new_tokens=8, temperature=0.0, seed=3))
                                  for t in TASKS],
        topics.TRAJECTORIES: trajs,
        topics.SCORED: [ScoredTrajectory(trajectory=t, reward=r) for t, r in zip(trajs, rewards)],
        topics.REWARDS: [reward_event(t, r, {"verify_seconds": 0.01}) for t, r in zip(trajs, rewards)],
        topics.WEIGHTS: [WeightUpdate(model="m", version=3, step=3, path="/ckpt/v3.safetensors", checksum="sha256:0",
                                      manifest=[{"name": "w", "shape": [2, 2], "dtype": "bfloat16"}])],
        topics.METRICS: [Metrics(source="trainer", step=3, policy_version=3, values={"loss/pg": 0.1}),
                         Metrics(source="trainer", step=3, policy_version=3, domain="toy",
                                 values={"train/pass_rate": 0.5}),
                         Metrics(source="scheduler", policy_version=3, domain="code",
                                 values={"eval/accuracy": 1.0, "eval/n": 8.0, "eval/round": 1.0})],
        topics.GROUP_DROPS: [GroupDropped(group_id="g", reason="stale", policy_version=4, behaviour_version=1,
                                          samples=4)],
        topics.ALERTS: [Alert(domain="toy", signal="breaker", severity="critical", value=0.9, threshold=0.5,
                              message="breaker open", details={"why": ["x"]})],
        topics.CONTROL: [Control(command="set_threshold", signal="kl", threshold={"warning": 0.1, "enabled": True}),
                         Control(command="domain_state", domain="toy", trainable=False, reason="circuit_open",
                                 drop_groups=["g"], origin="scheduler")],
        topics.DLQ: [DeadLetter(source_topic=topics.REWARDS, partition=0, offset=7, consumer="scheduler",
                                reason="not JSON", payload="{oops")],
    }


def _validator(topic: str) -> Draft202012Validator:
    schema = json.loads((SCHEMA_DIR / f"{topic}.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def test_committed_schema_files_are_up_to_date():
    """Regenerated in memory, every file under docs/schemas/ is what is committed (and nothing else is there)."""
    want = expected_files()
    have = {p.name: p.read_text() for p in SCHEMA_DIR.glob("*.json")}
    assert sorted(have) == sorted(want), "run: python -m shared.schema_export"
    stale = [name for name, text in want.items() if have[name] != text]
    assert not stale, f"{stale} are out of date: run python -m shared.schema_export"
    assert write(SCHEMA_DIR, check=True) == []


def test_every_topic_has_a_schema_with_its_identity():
    assert set(TOPIC_RECORDS) == set(topics.ALL)
    for topic, cls in TOPIC_RECORDS.items():
        s = topic_schema(topic)
        assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert s["$id"] == f"urn:flywheel:schema:{topic}:v{cls.VERSION}" and topic in s["title"]
        assert (s["x-flywheel-topic"], s["x-flywheel-schema"], s["x-flywheel-schema-version"]) == (
            topic, cls.SCHEMA, cls.VERSION)
        assert s["properties"]["schema"]["const"] == cls.SCHEMA and s["required"][:2] == ["schema", "schema_version"]
        # what decode accepts (validation) is what encode writes (serialization): one schema serves both
        assert cls.model_json_schema(mode="validation") == cls.model_json_schema(mode="serialization")


@pytest.mark.parametrize("topic", sorted(TOPIC_RECORDS))
def test_schema_validates_encoded_records_and_rejects_what_decode_rejects(topic):
    validator = _validator(topic)
    cls = TOPIC_RECORDS[topic]
    samples = _samples()[topic]
    assert samples
    for rec in samples:
        obj = orjson.loads(rec.encode())
        validator.validate(obj)
        assert decode(rec.encode(), cls) == rec
        # an unknown field: the strict schema and the decoder both refuse it; the lenient schema ignores it
        extra = {**obj, "a_field_from_the_future": 1}
        with pytest.raises(ValidationError, match="a_field_from_the_future"):
            validator.validate(extra)
        with pytest.raises(DecodeError, match="a_field_from_the_future"):
            decode(orjson.dumps(extra), cls)
        Draft202012Validator(lenient(validator.schema)).validate(extra)
        # a required field missing, or of the wrong type, fails both too
        required = [f for f in validator.schema["required"] if f not in ("schema", "schema_version")]
        missing = {k: v for k, v in obj.items() if k != required[0]}
        with pytest.raises(ValidationError):
            validator.validate(missing)
        with pytest.raises(DecodeError):
            decode(orjson.dumps(missing), cls)
        with pytest.raises(ValidationError):
            validator.validate({**obj, "schema_version": cls.VERSION + 1})


def test_a_reward_event_written_before_the_analyst_fields_still_validates_and_decodes():
    ev = _samples()[topics.REWARDS][1]
    assert ev.gates == ["format"] and ev.components == {"correctness": 1.0, "format": 0.0}
    assert ev.hacks == ["multiple_answers"] and ev.verifier_kind == "unit_tests" and ev.event_time > 0
    old = {k: v for k, v in orjson.loads(ev.encode()).items()
           if k not in ("event_time", "verifier_kind", "components", "gates", "hacks")}
    _validator(topics.REWARDS).validate(old)
    back = decode(orjson.dumps(old), RewardEvent)
    assert (back.event_time, back.verifier_kind, back.components, back.gates) == (None, None, {}, [])


def _committed(name: str) -> dict | None:
    """The file as committed in git's HEAD (``None``: not committed yet, or no git here)."""
    try:
        r = subprocess.run(["git", "-C", str(SCHEMA_DIR), "show", f"HEAD:./{name}"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.mark.parametrize("topic", sorted(TOPIC_RECORDS))
def test_schema_is_compatible_with_the_committed_one(topic):
    """Within a version a schema only gains optional fields: checked against git HEAD's file, and against the
    file in the tree (which the export refuses to overwrite with an incompatible schema)."""
    new = topic_schema(topic)
    for old in (_committed(f"{topic}.json"), json.loads((SCHEMA_DIR / f"{topic}.json").read_text())):
        if old is not None:
            assert compatibility_problems(old, new) == []


def test_compatibility_rule_flags_breaking_changes_and_allows_optional_additions():
    old = topic_schema(topics.REWARDS)

    def changed(edit) -> list[str]:
        new = json.loads(json.dumps(old))
        edit(new)
        return compatibility_problems(old, new)

    assert changed(lambda s: None) == []
    assert changed(lambda s: s["properties"].update(note={"type": "string", "default": ""})) == []
    assert changed(lambda s: s["properties"]["reward"].update(description="reworded")) == []
    assert changed(lambda s: s["required"].remove("reward")) == []  # a required field may become optional
    assert "removed" in changed(lambda s: s["properties"].pop("gates"))[0]
    assert "type changed" in changed(lambda s: s["properties"]["reward"].update(type="string"))[0]
    assert "type changed" in changed(lambda s: s["properties"]["purpose"]["enum"].append("probe"))[0]
    assert "newly required" in changed(lambda s: s["required"].append("gates"))[0]
    assert "added as a required" in changed(lambda s: (s["properties"].update(n={"type": "integer"}),
                                                        s["required"].append("n")))[0]
    assert "additionalProperties" in changed(lambda s: s.update(additionalProperties=True))[0]
    assert changed(lambda s: (s["properties"].pop("gates"), s.update({"x-flywheel-schema-version": 2}))) == []
    assert "went down" in changed(lambda s: s.update({"x-flywheel-schema-version": 0}))[0]
    nested = topic_schema(topics.SCORED)
    broken = json.loads(json.dumps(nested))
    broken["$defs"]["TrainSample"]["properties"].pop("loss_mask")  # flywheel.scored v3: the lean TrainSample
    assert compatibility_problems(nested, broken) == ["$defs.TrainSample.loss_mask: removed (or renamed)"]


def test_the_export_refuses_an_incompatible_schema_under_the_same_version(tmp_path):
    assert write(tmp_path) == [] and write(tmp_path, check=True) == []
    path = tmp_path / f"{topics.REWARDS}.json"
    committed = json.loads(path.read_text())
    committed["properties"]["retired_field"] = {"type": "string"}  # a field the new code no longer has
    path.write_text(json.dumps(committed))
    problems = write(tmp_path)
    assert len(problems) == 1 and "retired_field: removed" in problems[0] and "bump" in problems[0]
    assert "retired_field" in path.read_text()  # not overwritten
    (tmp_path / "flywheel.gone.json").write_text("{}")
    assert any("flywheel.gone.json" in p for p in write(tmp_path, check=True))
