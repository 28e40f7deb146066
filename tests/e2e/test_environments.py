"""A user's environment through the front door: a file with a dataset and a Python reward, named in the YAML,
trains with ``flywheel run`` and no change to Flywheel; one that cannot load stops the run before anything
starts, naming what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from flywheel.broker import die_with_parent
from shared.model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]

ENV = '''
import random

from flywheel.env import Environment


def starts_lowercase(completion: str) -> float:
    """The toy domain's reward, as a user would write it: 1.0 when the answer starts with a lowercase letter."""
    return float(completion[:1].islower())


def load_environment(n: int = 80, seed: int = 0) -> Environment:
    rng = random.Random(seed)
    rows = [{"question": "".join(rng.choice("0123456789") for _ in range(6)), "answer": None} for _ in range(n)]
    return Environment(dataset=rows, rubric=[starts_lowercase], name="lowercase")
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _config(tmp_path: Path, tiny: Path, environment: dict) -> Path:
    cfg = yaml.safe_load((ROOT / "examples/toy.yaml").read_text())
    cfg["model"]["name"] = str(tiny)
    cfg["run"]["dir"] = str(tmp_path / "runs")
    cfg["tasks"] = {"kind": "environment", "environment": environment, "train_size": 64, "eval_size": 16,
                    "samples_per_task": 8,
                    "recipe": {"reason": "no truncation gate: every completion hits the 4-token budget by design"}}
    path = tmp_path / "env.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(config: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "run", str(config), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, preexec_fn=die_with_parent())


def test_an_environment_file_named_in_the_yaml_trains(tiny, tmp_path):
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "lowercase.py").write_text(textwrap.dedent(ENV))
    report = tmp_path / "report.json"
    r = _run(_config(tmp_path, tiny, {"path": "envs/lowercase.py"}), "--report", str(report), "--timeout", "400",
             cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["steps"] == 25 and rep["dropped_groups"].get("infra_error", 0) == 0, rep["dropped_groups"]
    before, after = rep["eval"]["before"]["accuracy"], rep["eval"]["after"]["accuracy"]
    assert after >= before + 0.5, (before, after, r.stdout[-2000:])


def test_an_environment_that_cannot_load_stops_the_run_before_anything_starts(tiny, tmp_path):
    r = _run(_config(tmp_path, tiny, {"path": "envs/missing.py"}), "--timeout", "120", cwd=tmp_path)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "envs/missing.py" in out and "is not a file" in out, out[-3000:]
    assert "system up" not in out and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("example", ["calculator/calculator.py", "guess_number/guess_number.py",
                                     "arithmetic_retry/arithmetic_retry.py"])
def test_a_shipped_multi_turn_environment_runs_its_loop_and_trains(tiny, tmp_path, example):
    """The tool environment (two Python tools, per-rollout state) and the multi-turn ones (``env_response``
    hints, a retry after a wrong answer) run their loops in the rollout and train a few steps; nothing is an
    infrastructure error."""
    config = _config(tmp_path, tiny, {"path": str(ROOT / "environments" / example), "args": {"n": 40}})
    report = tmp_path / "report.json"
    r = _run(config, "--set", "budget.max_steps=3", "--set", "tasks.eval_size=4", "--set", "scheduler.max_tokens=8",
             "--set", "scheduler.eval_every=0", "--report", str(report), "--timeout", "400", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["steps"] == 3 and rep["dropped_groups"].get("infra_error", 0) == 0, rep["dropped_groups"]
