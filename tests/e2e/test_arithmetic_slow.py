"""The main job: SmolLM2-135M-Instruct learns basic arithmetic through all five services (~12 min).

Run with ``python3 -m pytest -q -m slow``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.broker import die_with_parent

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_arithmetic_held_out_accuracy_rises(tmp_path):
    report = tmp_path / "arithmetic.json"
    subprocess.run([sys.executable, "-m", "flywheel.cli", "run", str(ROOT / "examples/arithmetic.yaml"),
                    "--report", str(report), "--set", f"run.dir={tmp_path}/runs", "--timeout", "1500"],
                   check=True, cwd=tmp_path, timeout=1700, preexec_fn=die_with_parent())
    rep = json.loads(report.read_text())
    before, after = rep["eval"]["before"], rep["eval"]["after"]
    assert before["n"] == after["n"] == 64
    # the issue: held-out accuracy "rises to at least 0.75 within 30 trainer steps" (evaluated every
    # 5 versions); four runs ended at 0.69-0.77 and all reached 0.75 by step 30 (README)
    reached = [e for e in rep["evals"] if e["policy_version"] <= 30 and e["accuracy"] >= 0.75]
    assert reached, rep["evals"]
    assert after["accuracy"] >= before["accuracy"] + 0.35, rep["eval"]  # and it stays up
    assert rep["steps"] == 30 and rep["wall_seconds"] < 15 * 60
