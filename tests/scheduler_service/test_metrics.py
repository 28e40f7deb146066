"""The scheduler's ``GET /metrics``: families fed by the real registry and drift guard, gauges read when
scraped, the content type, and the domain-label cap (no broker: REST-only state)."""

from __future__ import annotations


from scheduler_service.guard import DriftGuard
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.metrics_feed import count_issued, count_reward, watch_state
from scheduler_service.registry import Registry
from shared.metrics import CONTENT_TYPE_PLAIN, OTHER, families, parse, render, total
from shared.schemas import RewardEvent, Task


def _ev(g, i: int, passed: bool, infra: bool = False, v: int = 0) -> RewardEvent:
    return RewardEvent(task_id=g.task_id, group_id=g.group_id, trajectory_id=f"{g.group_id}:{i}", sample_index=i,
                       group_size=g.n, domain=g.domain, difficulty=0.0, purpose=g.purpose, reward=float(passed), passed=passed,
                       infra_error=infra, completion_tokens=3, finish_reason="stop", policy_version=v,
                       cost={"generated_tokens": 3.0, "verify_seconds": 0.01})


async def test_metrics_count_groups_samples_alerts_and_read_breakers_and_spend(make_config, running, task):
    async with running(make_config(), kafka=False) as (client, state):
        body = [task("t-toy"), task("t-code", domain="code")]
        assert (await client.post("/v1/tasks", json={"tasks": body})).status_code == 202
        reg, m = state.registry, state.metrics
        groups = reg.issue_train_groups(["t-toy", "t-code"], deadline_s=60)
        count_issued(m, groups)
        reg.raise_policy_version(2)
        for g in groups:
            for i in range(g.n):
                ev = _ev(g, i, passed=(i == 0 and g.domain == "toy"), infra=(g.domain == "code" and i == 1))
                count_reward(m, ev, reg.record_reward(ev), reg.policy_version)
        assert (await client.post("/v1/domains/toy/breaker/open")).status_code == 200

        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_PLAIN
        s = parse(r.text)
        by_domain = lambda name, d: total(s, name, lambda lab: lab.get("domain") == d)  # noqa: E731
        assert by_domain("flywheel_scheduler_groups_issued_total", "toy") == 1
        assert by_domain("flywheel_scheduler_groups_issued_total", "code") == 1
        assert by_domain("flywheel_scheduler_groups_completed_total", "toy") == 1
        assert by_domain("flywheel_scheduler_samples_scored_total", "toy") == 2
        assert by_domain("flywheel_scheduler_samples_passed_total", "toy") == 1
        assert by_domain("flywheel_scheduler_samples_scored_total", "code") == 1
        assert by_domain("flywheel_scheduler_infra_errors_total", "code") == 1
        assert total(s, "flywheel_scheduler_staleness_versions_count") == 3  # scored training samples
        assert total(s, "flywheel_scheduler_staleness_versions_bucket", lambda lab: lab["le"] == "1.0") == 0
        assert total(s, "flywheel_scheduler_staleness_versions_bucket", lambda lab: lab["le"] == "2.0") == 3
        assert s["flywheel_scheduler_policy_version"] == [({}, 2.0)]
        assert s["flywheel_scheduler_in_flight_groups"] == [({}, 0.0)]
        assert by_domain("flywheel_scheduler_breaker_state", "toy") == 2  # open
        assert by_domain("flywheel_scheduler_breaker_state", "code") == 0
        spent = {(lab["domain"], lab["purpose"], lab["resource"]): v for lab, v in s["flywheel_scheduler_budget_spent"]}
        assert spent[("toy", "train", "samples")] == 2 and spent[("toy", "train", "generated_tokens")] == 6
        assert spent[("code", "train", "groups")] == 1
        alerts = {(lab["signal"], lab["severity"], lab["status"]): v for lab, v in s["flywheel_scheduler_alerts_total"]}
        assert alerts[("breaker", "critical", "firing")] == 1  # the operator's open, counted as it was published
        assert total(s, "flywheel_scheduler_alerts_firing", lambda lab: lab["severity"] == "critical") == 1
        kinds = families(r.text)
        assert kinds["flywheel_scheduler_groups_issued"] == "counter"
        assert kinds["flywheel_scheduler_breaker_state"] == "gauge"
        assert kinds["flywheel_scheduler_staleness_versions"] == "histogram"


def test_more_domains_than_the_cap_fold_into_other(tmp_path, make_config):
    reg = Registry(tmp_path / "r.db")
    try:
        m = SchedulerMetrics(max_domains=128)
        tasks = [Task(task_id=f"t{i}", domain=f"d{i:03d}", prompt=[{"role": "user", "content": f"x {i}"}],
                      verifier={"kind": "exact", "answer": "a"}, samples_per_task=2) for i in range(300)]
        reg.register_tasks(tasks)
        groups = reg.issue_train_groups([t.task_id for t in tasks], deadline_s=60)
        count_issued(m, groups)
        ev = _ev(groups[0], 0, passed=True)
        count_reward(m, ev, reg.record_reward(ev), 0)

        guard = DriftGuard(make_config(), reg, None, metrics=m)
        watch_state(m, reg, lambda: guard)
        s = parse(render(m.registry)[0].decode())
        issued = {lab["domain"] for lab, _ in s["flywheel_scheduler_groups_issued_total"]}
        assert len(issued) == 128 + 1 and OTHER in issued
        assert total(s, "flywheel_scheduler_groups_issued_total") == 300
        assert total(s, "flywheel_scheduler_groups_issued_total", lambda lab: lab["domain"] == OTHER) == 300 - 128
        breakers = {lab["domain"] for lab, _ in s["flywheel_scheduler_breaker_state"]}
        assert len(breakers) == 128 + 1
        spent = {lab["domain"] for lab, _ in s["flywheel_scheduler_budget_spent"]}
        assert len(spent) <= 128 + 1
    finally:
        reg.close()
