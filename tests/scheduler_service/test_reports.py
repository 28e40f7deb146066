"""The scheduler's records on flywheel.metrics: eval results once per finished round (also across a restart)
and the periodic gauges, against a real registry and the real broker."""

from __future__ import annotations

import time

import pytest

from scheduler_service.registry import Registry
from scheduler_service.reports import EVAL_PUBLISHED_KEY, Reporter, eval_records, gauge_values
from scheduler_service.stats import Stats
from shared import topics
from shared.kafka import ensure_topics, make_producer
from shared.schemas import Metrics, RewardEvent, Task


def _task(tid: str, domain: str, split: str = "eval") -> Task:
    return Task(task_id=tid, domain=domain, prompt=[{"role": "user", "content": f"x {tid}"}],
                verifier={"kind": "exact", "answer": "a"}, samples_per_task=2, split=split)


def _ev(group_id: str, task_id: str, domain: str, passed: bool, v: int) -> RewardEvent:
    return RewardEvent(task_id=task_id, group_id=group_id, trajectory_id=f"{group_id}:0", sample_index=0,
                       group_size=1, domain=domain, difficulty=0.0, purpose="eval", reward=float(passed),
                       passed=passed, completion_tokens=3, finish_reason="stop", policy_version=v)


def test_eval_records_run_wide_then_per_domain_with_accuracy_over_scored_items():
    summary = {"eval_round": 4, "n": 5, "completed": 4, "correct": 3, "abandoned": 1, "min_policy_version": 6,
               "policy_versions": [6, 7]}
    recs = eval_records(summary, {"code": (1, 2), "alpha": (2, 2), "empty": (0, 0)})
    assert [(m.source, m.domain, m.policy_version, m.step) for m in recs] == [
        ("scheduler", None, 7, None), ("scheduler", "alpha", 7, None), ("scheduler", "code", 7, None),
        ("scheduler", "empty", 7, None)]
    assert recs[0].values == {"eval/accuracy": 0.75, "eval/correct": 3.0, "eval/n": 4.0, "eval/round": 4.0,
                              "eval/min_policy_version": 6.0, "eval/items": 5.0, "eval/abandoned": 1.0}
    assert recs[2].values == {"eval/accuracy": 0.5, "eval/correct": 1.0, "eval/n": 2.0, "eval/round": 4.0,
                              "eval/min_policy_version": 6.0}
    assert "eval/accuracy" not in recs[3].values  # nothing scored: no accuracy rather than a made-up 0
    none_answered = eval_records({**summary, "policy_versions": []}, {})
    assert [m.policy_version for m in none_answered] == [6]


def test_gauges_count_groups_and_breakers(tmp_path):
    reg = Registry(tmp_path / "r.db")
    try:
        reg.register_tasks([_task("t1", "toy", "train"), _task("e1", "toy")])
        reg.issue_train_groups(["t1"], 60)
        reg.create_eval_round(0)
        v = gauge_values(reg, Stats(), {"toy": "open", "b": "half_open", "c": "closed"}, 2)
    finally:
        reg.close()
    assert v["scheduler/groups_in_flight"] == 1.0 and v["scheduler/groups_pending"] == 1.0
    assert v["scheduler/groups_issued"] == 1.0 and v["scheduler/train_groups_budgeted"] == 1.0
    assert (v["scheduler/breakers_open"], v["scheduler/breakers_half_open"], v["scheduler/alerts_active"]) == (1, 1, 2)
    assert (v["scheduler/tasks_train"], v["scheduler/tasks_eval"], v["scheduler/policy_version"]) == (1, 1, 0)
    assert v["scheduler/samples_per_s"] == 0.0 and "scheduler/staleness_mean" not in v


@pytest.mark.kafka
async def test_each_finished_eval_round_is_published_once_even_across_a_restart(kafka_cfg, tmp_path, unique,
                                                                                 read_topic):
    await ensure_topics(kafka_cfg)
    path = tmp_path / "r.db"
    reg = Registry(path)
    toy, code = f"toy-{unique}", f"code-{unique}"
    reg.register_tasks([_task(f"{unique}-a", toy), _task(f"{unique}-b", toy), _task(f"{unique}-c", code)])
    producer = make_producer(kafka_cfg)
    await producer.start()
    t0 = time.time()  # tests run one at a time: the scheduler records since then are this test's
    mine = lambda m: m.source == "scheduler" and m.time >= t0 and "eval/round" in m.values  # noqa: E731
    try:
        r0 = reg.create_eval_round(0)
        reg.create_eval_round(2)  # round 1 stays open: never published
        reporter = Reporter(reg, Stats(), producer, 3600, dict, lambda: 0)
        assert await reporter.publish_finished_evals() == []  # nothing finished yet
        for g in reg.take_pending(60):
            if g.eval_round == r0:  # round 0 finishes: toy 1 of 2, code 1 of 1; round 1 stays open
                reg.record_reward(_ev(g.group_id, g.task_id, g.domain, g.task_id != f"{unique}-b", 1))
        assert await reporter.publish_finished_evals() == [r0]
        assert await reporter.publish_finished_evals() == []
        reg.close()
        reg = Registry(path)  # a restarted scheduler publishes nothing again
        assert reg.kv_get(EVAL_PUBLISHED_KEY) == r0
        assert await Reporter(reg, Stats(), producer, 3600, dict, lambda: 0).publish_finished_evals() == []
        await Reporter(reg, Stats(), producer, 0.01, lambda: {"x": "open"}, lambda: 0).tick()  # + one gauge record
    finally:
        await producer.stop()
        reg.close()
    got = await read_topic(kafka_cfg, topics.METRICS, Metrics, 4, keep=mine, expect=3)  # 3: none twice
    assert [(m.domain, m.values.get("eval/accuracy"), m.values["eval/n"], m.values["eval/round"], m.policy_version)
            for m in got] == [(None, 2 / 3, 3.0, r0, 1), (code, 1.0, 1.0, r0, 1), (toy, 0.5, 2.0, r0, 1)]
    gauges = await read_topic(kafka_cfg, topics.METRICS, Metrics, 1, timeout_s=10,
                              keep=lambda m: m.source == "scheduler" and m.time >= t0
                              and m.values.get("scheduler/breakers_open") == 1)
    assert gauges and gauges[0].domain is None and gauges[0].values["scheduler/tasks_eval"] == 3
    assert gauges[0].values["scheduler/groups_completed"] == 3 and gauges[0].values["scheduler/groups_in_flight"] == 3
