"""Every service's Prometheus ``/metrics`` during the live toy run (the ``observed`` system).

Each service is scraped at the URL the launcher gives (``LocalSystem.metrics_urls``, also in
``flywheel.json``) and parsed with prometheus-client's own parser. The families the toy run must have fed
(:data:`ACTIVE`) are present with a non-zero value; those that only move on trouble (dead letters,
infrastructure errors, drops, alerts: :data:`PRESENT`) are present; the domain labels ``toy`` and ``code``
appear where groups, samples and rewards are counted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from flywheel.launcher import SERVICES
from shared.metrics import CONTENT_TYPE_PLAIN, Samples, families, label_values, parse, total

ACTIVE: dict[str, list[str]] = {
    "scheduler": ["flywheel_scheduler_groups_issued_total", "flywheel_scheduler_groups_completed_total",
                  "flywheel_scheduler_samples_scored_total", "flywheel_scheduler_staleness_versions_count",
                  "flywheel_scheduler_policy_version", "flywheel_scheduler_budget_spent"],
    "rollout": ["flywheel_rollout_generate_seconds_count", "flywheel_rollout_batch_seconds_count",
                "flywheel_rollout_samples_total", "flywheel_rollout_generated_tokens_total",
                "flywheel_rollout_policy_version", "flywheel_rollout_weight_load_seconds_count"],
    "verifier": ["flywheel_verifier_verify_seconds_count", "flywheel_verifier_rewards_total",
                 "flywheel_verifier_sandbox_seconds_count"],
    "trainer": ["flywheel_trainer_phase_seconds_count", "flywheel_trainer_steps_total",
                "flywheel_trainer_policy_version", "flywheel_trainer_staleness_versions_count",
                "flywheel_trainer_samples_trained_total", "flywheel_trainer_groups_trained_total",
                "flywheel_trainer_weight_publish_seconds_count"],
    "sandbox": ["flywheel_sandbox_runs_total", "flywheel_sandbox_execution_seconds_count",
                "flywheel_sandbox_attempts_total", "flywheel_sandbox_workers_started_total",
                "flywheel_sandbox_workers_alive", "flywheel_sandbox_workers_configured"],
}
"""Per service, the samples the toy run must have moved (sum over labels > 0)."""
PRESENT: dict[str, list[str]] = {
    "scheduler": ["flywheel_scheduler_groups_reissued", "flywheel_scheduler_groups_abandoned_total",
                  "flywheel_scheduler_samples_passed", "flywheel_scheduler_infra_errors",
                  "flywheel_scheduler_group_drops", "flywheel_scheduler_dlq_records", "flywheel_scheduler_alerts",
                  "flywheel_scheduler_in_flight_groups", "flywheel_scheduler_pending_groups",
                  "flywheel_scheduler_breaker_state", "flywheel_scheduler_budget_cap",
                  "flywheel_scheduler_alerts_firing", "flywheel_scheduler_training_paused"],
    "rollout": ["flywheel_rollout_requests_dropped", "flywheel_rollout_dlq_records"],
    "verifier": ["flywheel_verifier_infra_errors", "flywheel_verifier_hacks", "flywheel_verifier_gates",
                 "flywheel_verifier_dlq_records"],
    "trainer": ["flywheel_trainer_groups_dropped", "flywheel_trainer_dlq_records"],
    "sandbox": ["flywheel_sandbox_environment_failures_total", "flywheel_sandbox_breaker_open",
                "flywheel_sandbox_busy_slots", "flywheel_sandbox_idle_slots", "flywheel_sandbox_waiting_runs"],
}
"""Per service, families that must exist (a labelled one may have no sample yet: only trouble moves it)."""


def _scrape_all(urls: dict[str, str]) -> tuple[dict[str, Samples], dict[str, dict[str, str]], dict[str, float]]:
    """``(samples, family types, seconds per scrape)`` of every service."""
    samples, kinds, seconds = {}, {}, {}
    with httpx.Client(timeout=10) as client:  # one client: a new one per request costs more than the scrape
        for name, url in urls.items():
            t0 = time.perf_counter()
            r = client.get(url)
            seconds[name] = time.perf_counter() - t0
            assert r.status_code == 200, (name, url, r.status_code)
            assert r.headers["content-type"] == CONTENT_TYPE_PLAIN, (name, r.headers["content-type"])
            samples[name], kinds[name] = parse(r.text), families(r.text)
    return samples, kinds, seconds


def test_every_service_serves_its_families_with_live_values_and_domain_labels(observed):
    urls = observed.system.metrics_urls
    assert set(urls) == set(SERVICES)
    state = json.loads((Path(observed.run_dir) / "flywheel.json").read_text())
    assert state["metrics_urls"] == urls
    s, kinds, seconds = _scrape_all(urls)
    print("scrape seconds:", {k: round(v, 4) for k, v in seconds.items()},
          "series:", {k: sum(map(len, v.values())) for k, v in s.items()})

    for svc, names in ACTIVE.items():
        for name in names:
            assert name in s[svc], f"{svc}: {name} missing; has {sorted(k for k in s[svc] if 'flywheel' in k)}"
            assert total(s[svc], name) > 0, f"{svc}: {name} is zero: {s[svc][name]}"
        for name in PRESENT[svc]:
            assert name in s[svc], f"{svc}: {name} missing"
        assert total(s[svc], "process_cpu_seconds_total") > 0, svc
        assert all(n.startswith(f"flywheel_{svc}_") for n in kinds[svc] if n.startswith("flywheel_")), kinds[svc]

    domains = {"toy", "code"}
    assert label_values(s["scheduler"], "flywheel_scheduler_groups_issued_total", "domain") >= domains
    assert label_values(s["scheduler"], "flywheel_scheduler_samples_scored_total", "domain") >= domains
    assert label_values(s["scheduler"], "flywheel_scheduler_breaker_state", "domain") >= domains
    assert label_values(s["scheduler"], "flywheel_scheduler_budget_spent", "domain") >= domains
    assert label_values(s["rollout"], "flywheel_rollout_samples_total", "domain") >= domains
    assert label_values(s["rollout"], "flywheel_rollout_generated_tokens_total", "domain") >= domains
    assert label_values(s["verifier"], "flywheel_verifier_rewards_total", "domain") >= domains
    assert label_values(s["trainer"], "flywheel_trainer_samples_trained_total", "domain") & domains

    # what the run did, seen from each side
    issued = lambda purpose: total(s["scheduler"], "flywheel_scheduler_groups_issued_total",  # noqa: E731
                                   lambda lab: lab["purpose"] == purpose)
    assert issued("train") > 0 and issued("eval") >= 2 * 16  # two eval rounds of 8 + 8 held-out tasks
    assert s["scheduler"]["flywheel_scheduler_policy_version"][0][1] >= 3
    assert total(s["trainer"], "flywheel_trainer_steps_total") >= 3
    assert s["trainer"]["flywheel_trainer_policy_version"][0][1] >= 3
    assert s["rollout"]["flywheel_rollout_policy_version"][0][1] >= 1
    kinds_scored = label_values(s["verifier"], "flywheel_verifier_verify_seconds_count", "kind")
    assert kinds_scored >= {"regex", "unit_tests"}
    phases = {lab["phase"] for lab, v in s["trainer"]["flywheel_trainer_phase_seconds_count"] if v > 0}
    assert phases >= {"wait_for_data", "train_step", "snapshot", "publish", "checkpoint"}
    assert total(s["sandbox"], "flywheel_sandbox_execution_seconds_count",
                 lambda lab: lab["language"] == "python") > 0
    assert s["sandbox"]["flywheel_sandbox_workers_configured"] == [({}, 2.0)]
    assert kinds["scheduler"]["flywheel_scheduler_staleness_versions"] == "histogram"
    assert kinds["rollout"]["flywheel_rollout_samples"] == "counter"
    assert kinds["trainer"]["flywheel_trainer_policy_version"] == "gauge"
    assert max(seconds.values()) < 2.0, seconds


def test_each_metrics_port_is_the_one_its_process_was_given(observed):
    """rollout, verifier and trainer got their port through ``FLYWHEEL_TELEMETRY__METRICS_PORT`` (the
    launcher sets it per service, the same on every restart)."""
    system = observed.system
    for name, port in system.metrics_ports.items():
        pid = system.services[name].process.pid
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        assert env["FLYWHEEL_TELEMETRY__METRICS_PORT"] == str(port), name
        assert system.metrics_urls[name] == f"http://127.0.0.1:{port}/metrics"
    assert len(set(system.metrics_ports.values())) == len(system.metrics_ports) == 3
