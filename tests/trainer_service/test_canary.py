"""The canary check: an engine that serves the published weights passes, one that skipped a weight update (or
holds another version) fails, its groups are dropped untrained with reason ``canary`` while another engine's
train, a ``run/canary`` alert fires and resolves once the engine passes again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout_service.engine import GenerationRequest
from rollout_service.torch_engine import TorchEngine
from shared import topics
from shared.canary import TOLERANCE, canary_diff
from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer
from shared.schemas import Alert, Reward, SamplingParams, ScoredTrajectory, Task, Trajectory
from trainer_service.canary import CanaryCheck
from trainer_service.groups import GroupBuffer

pytestmark = pytest.mark.usefixtures("float32_numerics")  # float32 engines on every CPU

TASK = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "q"}],
            verifier={"kind": "regex", "pattern": "^a"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base model and "trained" weights (another initialisation), as directories."""
    root = tmp_path_factory.mktemp("canary")
    return build_tiny_model(root / "base", seed=0), build_tiny_model(root / "trained", seed=7)


def _group(buf: GroupBuffer, engine: TorchEngine, gid: str, offset: int) -> None:
    """Generate a group of 2 with ``engine`` and add its scored samples to ``buf`` (rewards 1 and 0)."""
    prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": "hi"}])
    samples = engine.generate([GenerationRequest(prompt, 2, SamplingParams(max_new_tokens=4))])[0]
    for i, s in enumerate(samples):
        tr = Trajectory(trajectory_id=f"{gid}:1:{i}", group_id=gid, sample_index=i, group_size=2, task=TASK,
                        prompt_ids=prompt, completion_ids=s.completion_ids, completion_logprobs=s.logprobs,
                        loss_mask=[1] * len(s.completion_ids), completion_text="x", finish_reason=s.finish_reason,
                        policy_versions=s.versions,
                        attestation=engine.attestation([v.version for v in s.versions]))
        buf.add(ScoredTrajectory(trajectory=tr, reward=Reward(total=float(i == 0))), ("s", 0), offset + i)


def test_an_engine_serving_the_published_weights_passes(models):
    base, _ = models
    engine = TorchEngine(load_model(base), load_tokenizer(base), seed=1)
    check = CanaryCheck(load_model(base), load_tokenizer(base))
    check.record(0)
    buf = GroupBuffer(max_staleness=1)
    _group(buf, engine, "g", 0)
    verdict = check.check(buf.ready[0])
    assert verdict.ok and verdict.worst is not None and verdict.worst < TOLERANCE["float32"]
    assert verdict.unchecked == 0 and not check.failing


def test_an_engine_that_skipped_a_weight_update_is_not_trained_until_it_passes(models):
    base, trained = models
    tok = load_tokenizer(base)
    check = CanaryCheck(load_model(trained), tok)
    check.record(3)  # the trainer published version 3: the trained weights
    good = TorchEngine(load_model(trained), tok, seed=1)
    good.policy_version = 3
    stale = TorchEngine(load_model(base), tok, seed=2)
    stale.policy_version = 3  # it says version 3 but kept the base weights: a skipped load
    good.engine_id, stale.engine_id = "replica-a:1", "replica-b:2"  # one engine per process in a deployment
    buf = GroupBuffer(max_staleness=1)
    _group(buf, stale, "bad", 0)
    _group(buf, good, "ok", 10)
    assert buf.drop_unless(lambda g: check.check(g).ok, "dropped_canary") == 1
    assert [g.group_id for g in buf.ready] == ["ok"] and buf.counters["dropped_canary"] == 1
    assert [(d.group_id, d.reason) for d in buf.take_drops()] == [("bad", "canary")]
    assert set(check.failing) == {stale.engine_id} and check.failing[stale.engine_id] > TOLERANCE["float32"]
    # the engine loads the published weights: its next group trains, and it is no longer failing
    stale.load_weights_state(load_model(trained).state_dict(), version=3)
    _group(buf, stale, "again", 20)
    assert buf.drop_unless(lambda g: check.check(g).ok, "dropped_canary") == 0 and not check.failing
    metrics = check.take_metrics()
    assert metrics["canary/abs_logp_diff_max"] > TOLERANCE["float32"] and metrics["canary/failing_engines"] == 0


def test_samples_without_a_comparable_score_are_counted_not_judged(models):
    base, _ = models
    tok = load_tokenizer(base)
    check = CanaryCheck(load_model(base), tok)
    check.record(5)  # the engine's version 0 is not held (before a restart, or older than keep)
    buf = GroupBuffer(max_staleness=10)
    _group(buf, TorchEngine(load_model(base), tok, seed=1), "old", 0)
    verdict = check.check(buf.ready[0])
    assert verdict.ok and verdict.worst is None and verdict.unchecked == 2
    assert check.take_metrics()["canary/unchecked_samples"] == 2


def test_int8_and_bf16_engines_are_judged_by_their_own_tolerance(models):
    base, trained = models
    tok = load_tokenizer(base)
    check = CanaryCheck(load_model(base), tok)
    mine = check.record(0)
    int8 = TorchEngine(load_model(base), tok, quantization="int8")
    int8.generate([GenerationRequest(encode_chat(tok, [{"role": "user", "content": "hi"}]), 1,
                                     SamplingParams(max_new_tokens=2))])
    att = int8.attestation([0])
    assert att.precision == "int8" and canary_diff(att.canary[0].logprobs, mine) < TOLERANCE["int8"]


async def test_a_failing_engine_fires_a_canary_alert_and_its_recovery_resolves_it(models, kafka_cfg, unique):
    from shared import kafka
    from tests.conftest import _read_topic
    from trainer_service.loop import TrainLoop

    base, trained = models
    check = CanaryCheck(load_model(trained), load_tokenizer(base))
    producer = kafka.make_producer(kafka_cfg)
    await producer.start()
    try:
        version = 1000 + int(unique, 16) % 1_000_000  # this test's alerts among the session's
        trainer = SimpleNamespace(canary=check, version=version)
        loop = TrainLoop(SimpleNamespace(), trainer, GroupBuffer(1), None, producer, SimpleNamespace(metrics=None))
        check.failing["host:1"] = 0.5
        await loop._canary_alert()
        await loop._canary_alert()  # still failing: no second record
        check.failing.clear()
        await loop._canary_alert()
    finally:
        await producer.stop()
    alerts = await _read_topic(kafka_cfg, topics.ALERTS, Alert, want=2,
                               keep=lambda a: a.signal == "canary" and a.policy_version == version, expect=2)
    mine = [a for a in alerts if a.details["engines"] == ["host:1"]]
    assert mine and mine[0].status == "firing" and mine[0].severity == "critical" and mine[0].key == "run/canary"
    assert [a.status for a in alerts][-1] == "resolved"


def test_an_engine_that_stops_reporting_stops_counting_as_failing(models):
    """A failing replica that is replaced never passes under its old id: after ``keep`` versions without a failure
    it no longer counts (so the alert can resolve)."""
    base, trained = models
    tok = load_tokenizer(base)
    check = CanaryCheck(load_model(trained), tok, keep=2)
    check.record(1)
    stale = TorchEngine(load_model(base), tok, seed=2)
    stale.policy_version = 1
    buf = GroupBuffer(max_staleness=1)
    _group(buf, stale, "bad", 0)
    assert not check.check(buf.ready[0]).ok and set(check.failing) == {stale.engine_id}
    for v in (2, 3):
        check.record(v)
    assert set(check.failing) == {stale.engine_id}  # 2 versions: still within keep
    check.record(4)
    assert check.failing == {}
