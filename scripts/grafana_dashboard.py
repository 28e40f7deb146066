"""The Grafana dashboard of docker-compose.yml, written from one panel table.

    python scripts/grafana_dashboard.py            # writes examples/compose/grafana/dashboards/flywheel.json
    python scripts/grafana_dashboard.py --check    # exits 1 when the committed file differs

Each panel is a time series of PromQL expressions over the services' Prometheus metrics (README
"Metrics"). ``tests/test_compose.py`` checks the committed file is what this script writes, and
``tests/e2e/observability/test_grafana.py`` checks every metric name the expressions use is served by a
running system.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "examples/compose/grafana/dashboards/flywheel.json"
DATASOURCE = {"type": "prometheus", "uid": "flywheel-prometheus"}


def _q(le: float, metric: str, by: str = "") -> str:
    """PromQL: the ``le`` quantile of histogram ``metric`` over 5 minutes, per ``by`` labels."""
    return f"histogram_quantile({le}, sum by (le{', ' + by if by else ''}) (rate({metric}_bucket[5m])))"


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (title, unit, [(PromQL, legend)])
    ("Policy version", "none", [("max(flywheel_trainer_policy_version)", "trainer"),
                                ("max(flywheel_rollout_policy_version)", "rollout (oldest replica: min)"),
                                ("max(flywheel_scheduler_policy_version)", "scheduler")]),
    ("Groups issued per second", "ops", [
        ("sum by (domain) (rate(flywheel_scheduler_groups_issued_total[1m]))", "{{domain}}")]),
    ("Pass rate by domain (5 min)", "percentunit", [
        ("sum by (domain) (rate(flywheel_scheduler_samples_passed_total[5m])) / "
         "sum by (domain) (rate(flywheel_scheduler_samples_scored_total[5m]))", "{{domain}}")]),
    ("Groups in flight and waiting to be sent", "none", [("max(flywheel_scheduler_in_flight_groups)", "in flight"),
                                                         ("max(flywheel_scheduler_pending_groups)", "pending")]),
    ("Staleness of trained samples (versions)", "none", [
        (_q(0.5, "flywheel_trainer_staleness_versions"), "p50"),
        (_q(0.95, "flywheel_trainer_staleness_versions"), "p95")]),
    ("Trainer step phases (mean seconds)", "s", [
        ("sum by (phase) (rate(flywheel_trainer_phase_seconds_sum[5m])) / "
         "sum by (phase) (rate(flywheel_trainer_phase_seconds_count[5m]))", "{{phase}}")]),
    ("Trained samples per second", "ops", [
        ("sum by (domain) (rate(flywheel_trainer_samples_trained_total[5m]))", "{{domain}}")]),
    ("Generation batch seconds", "s", [(_q(0.5, "flywheel_rollout_batch_seconds"), "p50"),
                                       (_q(0.95, "flywheel_rollout_batch_seconds"), "p95")]),
    ("Generated tokens per second", "ops", [
        ("sum by (domain) (rate(flywheel_rollout_generated_tokens_total[1m]))", "{{domain}}")]),
    ("Verify seconds p95 by verifier kind", "s", [(_q(0.95, "flywheel_verifier_verify_seconds", "kind"),
                                                    "{{kind}}")]),
    ("Sandbox execution seconds p95", "s", [(_q(0.95, "flywheel_sandbox_execution_seconds", "language"),
                                             "{{language}}"),
                                            (_q(0.95, "flywheel_verifier_sandbox_seconds"), "verifier's call")]),
    ("Weight sync seconds", "s", [(_q(0.95, "flywheel_trainer_weight_publish_seconds"), "publish p95"),
                                  (_q(0.95, "flywheel_rollout_weight_load_seconds"), "load p95")]),
    ("Groups dropped by reason", "ops", [
        ("sum by (reason) (rate(flywheel_trainer_groups_dropped_total[5m]))", "{{reason}}")]),
    ("Infrastructure errors", "ops", [
        ("sum by (domain) (rate(flywheel_scheduler_infra_errors_total[5m]))", "{{domain}}"),
        ("sum by (kind) (rate(flywheel_verifier_infra_errors_total[5m]))", "verifier {{kind}}")]),
    ("Dead-letter records", "none", [
        ("sum(flywheel_scheduler_dlq_records_total) + sum(flywheel_rollout_dlq_records_total) + "
         "sum(flywheel_verifier_dlq_records_total) + sum(flywheel_trainer_dlq_records_total)", "all services")]),
    ("Alerts firing", "none", [("sum by (severity) (flywheel_scheduler_alerts_firing)", "{{severity}}")]),
    ("Circuit breakers (0 closed, 1 half-open, 2 open)", "none", [
        ("max by (domain) (flywheel_scheduler_breaker_state)", "{{domain}}")]),
    ("Training budget spent", "none", [
        ('sum by (domain, resource) (flywheel_scheduler_budget_spent{purpose="train", '
         'resource=~"samples|generated_tokens|sandbox_seconds|judge_calls"})', "{{domain}} {{resource}}")]),
    ("Reward-hack detector hits", "ops", [
        ("sum by (detector) (rate(flywheel_verifier_hacks_total[5m]))", "{{detector}}")]),
]
"""The dashboard's panels, in order (two per row)."""


def metric_names() -> set[str]:
    """Every metric name the panels' expressions use, as exposed (``_total``, ``_bucket``... included)."""
    return {m for _, _, exprs in PANELS for e, _ in exprs for m in re.findall(r"\bflywheel_[a-z0-9_]+", e)}


def dashboard() -> dict:
    """The dashboard JSON (Grafana schema 39): one time-series panel per :data:`PANELS` row, two per row."""
    panels = []
    for i, (title, unit, exprs) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": e, "legendFormat": leg}
                        for j, (e, leg) in enumerate(exprs)],
        })
    return {"uid": "flywheel", "title": "Flywheel", "tags": ["flywheel"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "panels": panels}


def render() -> str:
    """The file's text: :func:`dashboard` as indented JSON with a final newline."""
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed file is out of date")
    args = ap.parse_args()
    if args.check:
        if not OUT.exists() or OUT.read_text() != render():
            print(f"{OUT} is out of date: run python scripts/grafana_dashboard.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(render())
    print(f"wrote {OUT} ({len(PANELS)} panels, {len(metric_names())} metric names)")


if __name__ == "__main__":
    main()
