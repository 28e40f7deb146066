"""Over a hundred domains at once through the five services and the embedded broker, with a tiny model.

``examples/many_domains.yaml`` (every shipped reasoning-gym generator as a domain, plus the other shipped
domains and the toy domain) is run with the tiny model, a 4-token budget and small task batches. From the
registry's issue order it checks: every domain issued; per-domain shares within ±2 % of the weights over
500 mix-issued groups; a weight change and a pause over REST shift the shares within the next 50 groups;
the toy domain (which the tiny model learns in a few steps) promoted to its next level, with new tasks
made at that level; and a saturated toy task retired from training.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from flywheel.launcher import LocalSystem
from shared.auth import auth_headers, token_from_run_dir
from shared.model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TOY = "toy"


def _config(tmp_path: Path, tiny: Path) -> tuple[Path, dict]:
    """The example with the tiny model and quick settings; the toy domain weighs 10 so it learns fast."""
    cfg = yaml.safe_load((ROOT / "examples/many_domains.yaml").read_text())
    assert len(cfg["domains"]) >= 100
    for name, d in cfg["domains"].items():
        d["eval_size"] = 0
        d["tasks_per_level"] = 3
        d["samples_per_task"] = 2
        d.pop("max_tokens", None)
        d["weight"] = 10.0 if name == TOY else float(d.get("weight", 1.0))
    toy = cfg["domains"][TOY]
    toy.update(tasks_per_level=16, samples_per_task=4, curriculum={"mode": "adaptive", "window": 16, "min_samples": 24,
                                               "promote_above": 0.7, "demote_below": 0.05},
               lifecycle={"retire_after": 2, "flag_after": 0})
    cfg.update(model={"name": str(tiny)}, run={"dir": str(tmp_path / "runs")}, tasks={"kind": "none"})
    cfg["budget"] = {"batch_groups": 16, "max_staleness": 1, "max_steps": 400}
    cfg["scheduler"] = {"max_tokens": 4, "temperature": 1.0, "eval_before_training": False, "issue_order": "fifo"}
    cfg["rollout"] = {"engine": "torch", "max_batch_samples": 64}
    cfg["trainer"] = {"loss": "bnpo", "truncation": "keep", "lr": 3.0e-3, "micro_batch_size": 32,
                      "keep_checkpoints": 1, "kl_coef": 0.0}
    cfg["verifier"] = {"math_workers": 1}
    # the shares measured here are the mix's: the drift monitor would (rightly) isolate the domains whose
    # scoring times out under this load (about five reasoning-gym domains hit an infra error rate of 1 at
    # start-up on 2 busy cores), which changes them
    cfg["monitor"] = {"enabled": False}
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _issued(db: Path) -> list[str]:
    """Domains of the mix-issued training groups (re-samples left out), in issue order."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("SELECT domain FROM \"groups\" WHERE purpose = 'train' AND resample_of IS NULL"
                           " ORDER BY rowid").fetchall()
    finally:
        con.close()
    return [r[0] for r in rows]


def _wait(pred, timeout_s: float, system: LocalSystem, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        system.check()
        v = pred()
        if v:
            return v
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def _shares_ok(window: list[str], weights: dict[str, float]) -> float:
    c, total = Counter(window), sum(weights.values())
    return max(abs(c[d] / len(window) - w / total) for d, w in weights.items())


@pytest.mark.timeout(1800)
def test_a_hundred_domains_mix_by_weight_learn_by_level_and_retire_saturated_tasks(tmp_path):
    tiny = build_tiny_model(tmp_path / "tiny")
    path, cfg = _config(tmp_path, tiny)
    weights = {d: c["weight"] for d, c in cfg["domains"].items()}
    system = LocalSystem.start(path, tmp_path / "run", timeout_s=300)
    db = system.run_dir / "flywheel-registry.db"
    url = system.scheduler_url
    try:
        first = _wait(lambda: (g := _issued(db)) and len(g) >= 500 and g, 900, system, "500 groups")[:500]
        assert set(first) == set(weights), sorted(set(weights) - set(first))  # every domain issued
        assert _shares_ok(first, weights) <= 0.02
        # a weight change and a pause over REST shift the shares at once
        heavy, paused = "basic_arithmetic", "leg_counting"
        auth = auth_headers(token_from_run_dir(system.run_dir))  # the mutating routes want the system's token
        assert httpx.patch(f"{url}/v1/domains/{heavy}", json={"weight": 40.0}, headers=auth,
                           timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/domains/{paused}/pause", headers=auth, timeout=30).status_code == 200
        weights[heavy] = 40.0
        del weights[paused]
        # The handlers run on the scheduler's event loop, where a plan is made and its rows written in one
        # go: every row written after both answers came from a plan made with the new settings. (A count
        # taken before the requests also holds plans written meanwhile, each up to two batches of groups
        # on a slow machine, which is more than any fixed margin.)
        n1 = len(_issued(db))
        nxt = _wait(lambda: (g := _issued(db)) and len(g) >= n1 + 50 and g, 600, system, "50 more groups")
        window = nxt[n1:n1 + 50]
        c = Counter(window)
        assert c[paused] == 0
        assert abs(c[heavy] / 50 - 40.0 / sum(weights.values())) <= 0.06, c[heavy]
        # a promotion changes the domain's row at once; its level-1 tasks come from the sampler's next task pass
        toy = _wait(lambda: (d := httpx.get(f"{url}/v1/domains/{TOY}", timeout=30).json())["level"] >= 1
                    and d["tasks"]["retired"] >= 1 and d["live_by_level"].get("1", 0) > 0 and d, 600, system,
                    "the toy domain's promotion, a retired task and a live level-1 task")
        assert any(e["kind"] == "promoted" for e in toy["events"]) and toy["live_by_level"].get("1", 0) > 0
        shown = subprocess.run([sys.executable, "-m", "flywheel.cli", "domains", "--url", url, "--json"],
                               capture_output=True, text=True, timeout=120, check=True)
        assert {d["domain"] for d in json.loads(shown.stdout)} >= set(weights)
        assert toy["retired_tasks"] and httpx.get(f"{url}/v1/tasks/{toy['retired_tasks'][0]}",
                                                  timeout=30).json()["state"] == "retired"
    finally:
        system.stop()
