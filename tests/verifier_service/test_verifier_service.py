"""The verifier service against the real embedded broker: scored, rewards, dead letters, metrics."""

from __future__ import annotations

import asyncio
import time

import pytest

from flywheel.broker import free_port
from flywheel.config import FlywheelConfig
from shared import topics
from shared.kafka import ensure_topics, make_producer, send
from shared.metrics import Samples, scrape, total
from shared.schemas import DeadLetter, Metrics, RewardEvent, ScoredTrajectory, Task, Trajectory, TrainSample
from verifier_service.main import run

pytestmark = pytest.mark.kafka


def _traj(unique: str, i: int, text: str, finish_reason: str = "stop") -> Trajectory:
    task = Task(task_id=f"task-{unique}", domain="toy", prompt=[{"role": "user", "content": "say a"}],
                verifier={"kind": "regex", "pattern": "^a"}, difficulty=0.25)
    return Trajectory(
        trajectory_id=f"{unique}:{i}", group_id=f"g-{unique}", sample_index=i, group_size=3, task=task,
        purpose="eval", eval_round=7, attempt=2, prompt_ids=[1, 2], completion_ids=[3, 4, 5],
        completion_logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 1, 1], completion_text=text,
        finish_reason=finish_reason, policy_versions=[{"version": 4, "start": 0, "end": 1},
                                                      {"version": 5, "start": 1, "end": 3}],
    )


async def _prometheus(config: FlywheelConfig) -> Samples:
    """The running service's Prometheus samples, from its metrics port."""
    return await asyncio.to_thread(scrape, f"http://127.0.0.1:{config.telemetry.metrics_port}/metrics")


async def test_service_scores_emits_rewards_and_dead_letters(kafka_cfg, unique, tmp_path, read_topic):
    await ensure_topics(kafka_cfg)
    config = FlywheelConfig(
        kafka=kafka_cfg, run={"dir": str(tmp_path)}, telemetry={"metrics_port": free_port()},
        verifier={"consumer_group": f"verifier-{unique}", "metrics_interval_s": 0.5},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run(config, stop))
    producer = make_producer(kafka_cfg)
    await producer.start()
    try:
        good, bad, aborted = _traj(unique, 0, "abc"), _traj(unique, 1, "xyz"), _traj(unique, 2, "", "abort")
        for t in (good, bad, aborted):
            await (await send(producer, topics.TRAJECTORIES, t, t.group_id))
        garbage_key = f"garbage-{unique}"
        await (await producer.send(topics.TRAJECTORIES, b"{not json " + unique.encode(), key=garbage_key.encode()))

        ids = {good.trajectory_id, bad.trajectory_id, aborted.trajectory_id}
        scored = await read_topic(kafka_cfg, topics.SCORED, ScoredTrajectory, 3,
                                  keep=lambda r: r.trajectory.trajectory_id in ids)
        rewards = await read_topic(kafka_cfg, topics.REWARDS, RewardEvent, 3, keep=lambda r: r.trajectory_id in ids)
        dead = await read_topic(kafka_cfg, topics.DLQ, DeadLetter, 1, keep=lambda r: unique in r.payload)
        metrics = await read_topic(kafka_cfg, topics.METRICS, Metrics, 1,
                                   keep=lambda r: r.source == "verifier" and r.values.get("verifier/dlq", 0) >= 1
                                   and r.values.get("verifier/scored", 0) >= 3)

        by_id = {s.trajectory.trajectory_id: s for s in scored}
        assert set(by_id) == ids
        assert by_id[good.trajectory_id].reward.total == 1.0
        assert not hasattr(by_id[good.trajectory_id].reward, "components")  # lean: on flywheel.rewards
        assert by_id[bad.trajectory_id].reward.total == 0.0 and not by_id[bad.trajectory_id].reward.infra_error
        assert by_id[aborted.trajectory_id].reward.infra_error  # not scored, flagged
        assert by_id[good.trajectory_id].trajectory == TrainSample.of(good)  # the trainer's part only (v3)

        ev = {r.trajectory_id: r for r in rewards}
        assert set(ev) == ids
        g = ev[good.trajectory_id]
        assert g.passed and g.reward == 1.0 and g.task_id == f"task-{unique}" and g.group_id == good.group_id
        assert g.components == {"correctness": 1.0, "truncation": 1.0}  # the safe default recipe, not cut off
        assert g.policy_version == 4 and g.completion_tokens == 3 and g.purpose == "eval"
        assert g.eval_round == 7 and g.attempt == 2 and g.group_size == 3 and g.sample_index == 0
        assert g.domain == "toy" and g.difficulty == 0.25 and g.finish_reason == "stop"
        assert not ev[bad.trajectory_id].passed and not ev[bad.trajectory_id].infra_error
        assert ev[aborted.trajectory_id].infra_error and not ev[aborted.trajectory_id].passed

        assert len(dead) == 1
        assert dead[0].source_topic == topics.TRAJECTORIES and dead[0].consumer == "verifier"
        assert "not JSON" in dead[0].reason
        assert metrics, "no verifier Metrics snapshot with the counts"

        # Prometheus (at least this test's records: the group reads the session broker's topic from the start)
        prom = await _prometheus(config)
        rewards = {(lab["domain"], lab["kind"], lab["passed"]): v for lab, v in prom["flywheel_verifier_rewards_total"]}
        assert rewards[("toy", "regex", "true")] >= 1 and rewards[("toy", "regex", "false")] >= 1
        assert total(prom, "flywheel_verifier_infra_errors_total", lambda lab: lab["kind"] == "regex") >= 1
        assert total(prom, "flywheel_verifier_dlq_records_total", lambda lab: lab["topic"] == topics.TRAJECTORIES) >= 1
        scored_regex = total(prom, "flywheel_verifier_verify_seconds_count", lambda lab: lab["kind"] == "regex")
        assert scored_regex == sum(rewards.values())  # an aborted generation is not scored, so not timed
        assert not task.done(), "the service stopped after a malformed record"
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    assert (tmp_path / "logs" / "verifier.log").exists()


@pytest.mark.e2e  # restarts the verifier: the e2e tier
async def test_service_commits_so_a_restart_does_not_rescore(kafka_cfg, unique, tmp_path, read_topic):
    await ensure_topics(kafka_cfg)
    config = FlywheelConfig(kafka=kafka_cfg, run={"dir": str(tmp_path)},
                            verifier={"consumer_group": f"verifier-{unique}"})
    producer = make_producer(kafka_cfg)
    await producer.start()
    try:
        t = _traj(unique, 0, "a")
        await (await send(producer, topics.TRAJECTORIES, t, t.group_id))
        stop = asyncio.Event()
        task = asyncio.create_task(run(config, stop))
        got = await read_topic(kafka_cfg, topics.REWARDS, RewardEvent, 1,
                               keep=lambda r: r.trajectory_id == t.trajectory_id)
        assert len(got) == 1
        stop.set()
        await asyncio.wait_for(task, timeout=30)

        # A marker after the first record; rewards share a partition (key task_id), so a redelivered
        # first record would show up before the marker's reward. (Re-joining the group can take
        # about a session timeout on the embedded broker.)
        t2 = _traj(unique, 1, "a")
        await (await send(producer, topics.TRAJECTORIES, t2, t2.group_id))
        stop2 = asyncio.Event()
        task2 = asyncio.create_task(run(config, stop2))
        try:
            got2 = await read_topic(kafka_cfg, topics.REWARDS, RewardEvent, 0,
                                    keep=lambda r: r.trajectory_id in (t.trajectory_id, t2.trajectory_id),
                                    until=lambda r: r.trajectory_id == t2.trajectory_id)
        finally:
            stop2.set()
            await asyncio.wait_for(task2, timeout=30)
        counts = {i: sum(r.trajectory_id == i for r in got2) for i in (t.trajectory_id, t2.trajectory_id)}
        assert counts == {t.trajectory_id: 1, t2.trajectory_id: 1}, counts
    finally:
        await producer.stop()


def _domain_traj(unique: str, i: int, body: dict, text: str, finish_reason: str = "stop") -> Trajectory:
    task = Task(task_id=body["task_id"] + unique, **{k: v for k, v in body.items() if k != "task_id"})
    return Trajectory(
        trajectory_id=f"{unique}:{i}", group_id=f"g-{unique}-{i}", sample_index=0, group_size=2, task=task,
        prompt_ids=[1], completion_ids=[3], completion_logprobs=[-0.1], loss_mask=[1], completion_text=text,
        finish_reason=finish_reason, policy_versions=[{"version": 0, "start": 0, "end": 1}],
    )


async def test_service_runs_domain_recipes_counts_hacks_and_gates_and_calibrates_the_judge(
        kafka_cfg, unique, tmp_path, read_topic):
    """Shipped domains through the service: each domain's recipe from the config, the components in the
    scored record, hack and gate counters and the periodic judge calibration in the metrics."""
    from flywheel.domains import get
    from tests.verifier_service.scripted_judge import ScriptedJudgeServer

    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text('{"prompt": "q", "response": "good", "label": 1, "rubric": "r"}\n'
                        '{"prompt": "q", "response": "bad", "label": 0, "rubric": "r"}\n')
    fin = get("financial_extraction").make(1, seed=2)[0]
    geo = get("geometry").make(1, seed=2)[0]
    with ScriptedJudgeServer(lambda u: "SCORE: 9" if "good" in u else "SCORE: 1") as url:
        await ensure_topics(kafka_cfg)
        config = FlywheelConfig(kafka=kafka_cfg, run={"dir": str(tmp_path)}, verifier={
            "consumer_group": f"verifier-{unique}", "metrics_interval_s": 0.5,
            "judge": {"base_url": url, "calibration_file": str(labelled), "calibration_every_s": 0.5},
            "recipes": {"geometry": {"rules": [{"rule": "format", "answer_tag": True}, {"rule": "truncation"}],
                                     "gates": ["format", "truncation"]}}}, telemetry={"metrics_port": free_port()})
        stop = asyncio.Event()
        task = asyncio.create_task(run(config, stop))
        producer = make_producer(kafka_cfg)
        await producer.start()
        try:
            trajs = [
                _domain_traj(unique, 0, fin, get("financial_extraction").gold(fin)),
                _domain_traj(unique, 1, geo, get("geometry").gold(geo)),
                _domain_traj(unique, 2, geo, get("geometry").gold(geo), finish_reason="length"),
                _domain_traj(unique, 3, fin, get("financial_extraction").gold(fin) + " <answer>{}</answer>"),
                _domain_traj(unique, 4, {**fin, "domain": "broken", "verifier": {
                    "kind": "reasoning_gym", "dataset": "composite", "entry": {"answer": "1"}}}, "1"),
            ]
            for t in trajs:
                await (await send(producer, topics.TRAJECTORIES, t, t.group_id))
            ids = {t.trajectory_id for t in trajs}
            scored = await read_topic(kafka_cfg, topics.SCORED, ScoredTrajectory, 5,
                                      keep=lambda r: r.trajectory.trajectory_id in ids)
            events = await read_topic(kafka_cfg, topics.REWARDS, RewardEvent, 5, keep=lambda r: r.trajectory_id in ids)
            metrics = await read_topic(
                kafka_cfg, topics.METRICS, Metrics, 1,
                keep=lambda r: r.source == "verifier" and r.values.get("verifier/gated_truncation", 0) >= 1
                and r.values.get("verifier/hack_multiple_answers", 0) >= 1)
            judge = await read_topic(kafka_cfg, topics.METRICS, Metrics, 1,
                                     keep=lambda r: r.source == "verifier" and "judge/accuracy" in r.values)
            prom = await _prometheus(config)
        finally:
            await producer.stop()
            stop.set()
            await asyncio.wait_for(task, timeout=30)
    r = {s.trajectory.trajectory_id: s.reward for s in scored}  # lean: total and infra_error only
    ev = {e.trajectory_id: e for e in events}  # the reward's components, gates and hacks are on flywheel.rewards
    assert r[f"{unique}:0"].total == 1.0 and ev[f"{unique}:0"].components == {"correctness": 1.0}
    assert r[f"{unique}:1"].total == 1.0
    assert ev[f"{unique}:1"].components == {"correctness": 1.0, "format": 1.0, "truncation": 1.0}
    assert r[f"{unique}:2"].total == 0.0 and ev[f"{unique}:2"].gates == ["truncation"]
    assert "multiple_answers" in ev[f"{unique}:3"].hacks
    assert metrics and judge[0].values["judge/accuracy"] == 1.0 and judge[0].values["judge/n"] == 2
    assert total(prom, "flywheel_verifier_hacks_total", lambda lab: lab["detector"] == "multiple_answers") >= 1
    assert total(prom, "flywheel_verifier_gates_total", lambda lab: lab["gate"] == "truncation") >= 1
    assert total(prom, "flywheel_verifier_rewards_total", lambda lab: lab["domain"] == "geometry") >= 2
    assert ev[f"{unique}:4"].misconfigured and "composite" in ev[f"{unique}:4"].reason  # the domain pauses
    assert not ev[f"{unique}:0"].misconfigured and ev[f"{unique}:0"].reason is None
    # the analyst's fields: the reward's components, the gates that fired, the hacks, the spec's kind
    for tid, e in ev.items():
        assert e.reward == r[tid].total and e.event_time is not None
        assert e.verifier_kind == next(t for t in trajs if t.trajectory_id == tid).task.verifier.kind
    assert ev[f"{unique}:2"].gates == ["truncation"] and ev[f"{unique}:2"].reward == 0.0
    assert ev[f"{unique}:1"].gates == [] and ev[f"{unique}:1"].components["format"] == 1.0
    assert "multiple_answers" in ev[f"{unique}:3"].hacks
    assert {e.verifier_kind for e in ev.values()} >= {"json_fields", "geometry"}
    assert all(time.time() - 120 < e.event_time <= time.time() for e in ev.values())


async def test_reward_events_carry_the_rollout_and_verifier_cost(kafka_cfg, unique, tmp_path, read_topic, sandbox_url):
    """``RewardEvent.cost``: the trajectory's cost (generated tokens, tool rounds and seconds) plus the
    verifier's own: unit tests' sandbox seconds, judge calls, seconds of scoring; nothing guessed."""
    from tests.verifier_service.scripted_judge import ScriptedJudgeServer

    def traj(i: int, verifier: dict, text: str, cost: dict | None = None, n_tokens: int = 3) -> Trajectory:
        task = Task(task_id=f"cost-{unique}-{i}", domain="toy", prompt=[{"role": "user", "content": "q"}],
                    verifier=verifier)
        return Trajectory(
            trajectory_id=f"{unique}:{i}", group_id=f"g-{unique}-{i}", sample_index=0, group_size=2, task=task,
            prompt_ids=[1], completion_ids=list(range(3, 3 + n_tokens)), completion_logprobs=[-0.1] * n_tokens,
            loss_mask=[1] * n_tokens, completion_text=text, finish_reason="stop", cost=cost or {},
            policy_versions=[{"version": 0, "start": 0, "end": n_tokens}])

    code = "```python\ndef f(x):\n    return 2 * x\n```"
    trajs = [
        traj(0, {"kind": "regex", "pattern": "^a"}, "abc",
             {"generated_tokens": 3.0, "tool_rounds": 0.0, "tool_seconds": 0.0}),
        traj(1, {"kind": "unit_tests", "entry_point": "f", "tests": [{"name": "double", "code": "assert f(2) == 4"}]},
             code, {"generated_tokens": 5.0, "tool_rounds": 1.0, "tool_seconds": 0.25}, n_tokens=7),
        traj(2, {"kind": "regex", "pattern": "Paris", "recipe": {"judge": {"rubric": "Names the capital."},
                                                                  "weights": {"correctness": 1, "judge": 1}}},
             "Paris"),  # no cost on the trajectory: generated_tokens is Σ loss_mask
    ]
    with ScriptedJudgeServer(lambda u: "SCORE: 8") as url:
        await ensure_topics(kafka_cfg)
        config = FlywheelConfig(kafka=kafka_cfg, run={"dir": str(tmp_path)}, telemetry={"metrics_port": free_port()},
                                verifier={"consumer_group": f"verifier-{unique}", "sandbox_url": sandbox_url,
                                          "judge": {"base_url": url}})
        stop = asyncio.Event()
        task = asyncio.create_task(run(config, stop))
        producer = make_producer(kafka_cfg)
        await producer.start()
        try:
            for t in trajs:
                await (await send(producer, topics.TRAJECTORIES, t, t.group_id))
            ids = {t.trajectory_id for t in trajs}
            events = await read_topic(kafka_cfg, topics.REWARDS, RewardEvent, 3, keep=lambda r: r.trajectory_id in ids)
            prom = await _prometheus(config)
        finally:
            await producer.stop()
            stop.set()
            await asyncio.wait_for(task, timeout=30)
    ev = {e.trajectory_id: e for e in events}
    plain, tested, judged = (ev[f"{unique}:{i}"] for i in range(3))
    # Prometheus (at least this test's records: the group reads the session broker's topic from the start)
    assert total(prom, "flywheel_verifier_sandbox_seconds_count") >= 1  # the unit tests' request
    assert total(prom, "flywheel_verifier_sandbox_seconds_sum") >= tested.cost["sandbox_seconds"] * 0.999
    assert total(prom, "flywheel_verifier_verify_seconds_count", lambda lab: lab["kind"] == "unit_tests") >= 1
    assert total(prom, "flywheel_verifier_rewards_total", lambda lab: lab["passed"] == "true") >= 3
    assert plain.passed and tested.passed and judged.reward == pytest.approx(0.9)  # (1 + 0.8) / 2
    assert plain.cost["generated_tokens"] == plain.completion_tokens == 3
    assert plain.cost["tool_rounds"] == 0 and plain.cost["tool_seconds"] == 0
    assert "sandbox_seconds" not in plain.cost and "judge_calls" not in plain.cost  # no such call was made
    assert tested.cost["sandbox_seconds"] > 0 and "judge_calls" not in tested.cost
    assert tested.cost["generated_tokens"] == 5 and tested.cost["tool_rounds"] == 1 and tested.cost["tool_seconds"] == 0.25
    assert tested.cost["verify_seconds"] >= tested.cost["sandbox_seconds"]  # the sandbox call is part of scoring
    assert judged.cost["judge_calls"] == 1 and judged.cost["generated_tokens"] == 3
    assert "sandbox_seconds" not in judged.cost
    assert all(0 < e.cost["verify_seconds"] < 60 for e in events)
