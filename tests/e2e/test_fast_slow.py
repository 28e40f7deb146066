"""A slow tool domain and a fast plain domain mixed under ``scheduler.issue_order: cost``, whole system.

The scenario of ``benchmarks/fast_slow_mixing.py`` (LocalSystem: embedded broker, five services, a tiny
model taught to answer the slow tasks' prompt with code), run briefly: ``slow`` tasks go through the
``test_feedback`` loop (their test sleeps 1 s in the sandbox, twice per sample), ``fast`` tasks are a
regex on 4 tokens. Checked: both domains' groups complete and neither starves (each gets at least a
third of the issued groups), the scheduler learns a larger ``seconds_per_group`` for ``slow`` than for
``fast``, and the rollout's Metrics records carry ``rollout/idle_fraction`` in [0, 1]. Behaviour, not
speed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.fast_slow_mixing import (  # noqa: E402
    DOMAINS, domains, rollout_metrics, serving, submit, system_config, tasks, teach, wait_for,
)
from flywheel.launcher import LocalSystem  # noqa: E402

LOOKAHEAD = 4
"""``scheduler.cost_lookahead``: the slow domain may be moved ahead at most this many times in a row, so
its count runs at most about ``LOOKAHEAD`` + 1 groups ahead of its share."""
MIN_ISSUED = 16
"""Issued training groups before the shares are judged: with the drift bound of :data:`LOOKAHEAD` each
domain holds at least a third from here on ((16 − 5) / 2 ≥ 16 / 3)."""


def _enough(url: str):
    """The domains once each has completed two groups and at least :data:`MIN_ISSUED` were issued."""
    d = domains(url)
    ok = all(d.get(x, {}).get("completed", 0) >= 2 for x in DOMAINS) and sum(d[x]["issued"] for x in DOMAINS) >= MIN_ISSUED
    return d if ok else None


@pytest.mark.timeout(480)
def test_cost_order_mixes_a_slow_tool_domain_with_a_fast_one_without_starving_either(tmp_path):
    t0 = time.monotonic()
    model_dir = teach(tmp_path / "tiny")
    cfg = tmp_path / "system.yaml"
    cfg.write_text(yaml.safe_dump(system_config(model_dir, tmp_path / "runs", "cost", lookahead=LOOKAHEAD)))
    system = LocalSystem.start(cfg, tmp_path / "run", timeout_s=180)
    try:
        wait_for(lambda: serving(system), 180, system, "the rollout service to serve")
        url = system.scheduler_url
        submit(url, tasks(32, sleep_s=1.0), system.token)
        d = wait_for(lambda: _enough(url), 150, system, "both domains' groups")
        records = wait_for(lambda: [r for r in rollout_metrics(system) if "rollout/idle_fraction" in r["values"]],
                           60, system, "a rollout Metrics record with rollout/idle_fraction", every_s=2.0)
        alerts = httpx.get(f"{url}/v1/alerts", timeout=30).json()
    finally:
        system.stop()
    issued = sum(d[x]["issued"] for x in DOMAINS)
    for x in DOMAINS:
        assert d[x]["completed"] >= 2, d
        assert d[x]["issued"] / issued >= 1 / 3, (d, alerts)  # no starvation
    assert d["slow"]["seconds_per_group"] > d["fast"]["seconds_per_group"], d
    assert all(0.0 <= r["values"]["rollout/idle_fraction"] <= 1.0 for r in records)
    v = records[-1]["values"]
    assert 0 < v["rollout/busy_s"] <= v["rollout/wall_s"]
    print(f"fast/slow e2e: {time.monotonic() - t0:.0f} s, domains {d}, idle {v['rollout/idle_fraction']:.3f}")
