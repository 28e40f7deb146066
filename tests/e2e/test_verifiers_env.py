"""An environment written for the ``verifiers`` library, unedited, trains with ``flywheel run``: the driver makes
tasks of its dataset, the scheduler and the rollout load it (the rollout runs its ToolEnv loop), the verifier
scores with its rubric; nothing is an infrastructure error."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.e2e.test_environments import _config, _run, tiny  # noqa: F401 - tiny is the module's model fixture

pytest.importorskip("verifiers", reason="the extra flywheel[verifiers] is not installed")

VF_ENV = '''
import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def starts_lowercase(completion) -> float:
    """The toy domain's reward on the last assistant message: 1.0 when it starts with a lowercase letter."""
    return float((completion[-1]["content"] or "")[:1].islower())


def load_environment(n: int = 40):
    rows = [{"question": f"{i:06d}", "answer": str(i)} for i in range(n)]
    rubric = vf.Rubric(funcs=[starts_lowercase], weights=[1.0])
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=2, rubric=rubric)
'''


def test_a_verifiers_tool_env_trains_a_few_steps(tiny, tmp_path):  # noqa: F811 - the imported fixture
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "vf_lowercase.py").write_text(textwrap.dedent(VF_ENV))
    config = _config(tmp_path, tiny, {"path": "envs/vf_lowercase.py"})
    report = tmp_path / "report.json"
    # one reward worker: each process that loads the environment imports verifiers (seconds of CPU each)
    r = _run(config, "--set", "budget.max_steps=3", "--set", "tasks.eval_size=4", "--set", "scheduler.max_tokens=8",
             "--set", "scheduler.eval_every=0", "--set", "verifier.reward_workers=1", "--report", str(report),
             "--timeout", "300", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["steps"] == 3 and rep["dropped_groups"].get("infra_error", 0) == 0, rep["dropped_groups"]
