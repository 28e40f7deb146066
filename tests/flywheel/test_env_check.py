"""``flywheel env check``: an environment loaded as the services load it and its rows made the tasks a run makes,
without a run; one completion scored with its rubric; and every way it can be wrong said in one line (exit 2)."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli import app

ENV = """
    from flywheel.env import Environment, Rubric

    def exact(completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    def length(completion: str) -> dict:
        return {"score": None, "chars": len(completion)}

    def load_environment(n: int = 6):
        rows = [{"question": f"Say {i}", "answer": str(i), "level": i % 2} for i in range(n)]
        return Environment(dataset=rows, eval_dataset=[{"question": "Say 99", "answer": "99"}],
                           rubric=Rubric([exact, length], weights=[1.0, 0.0]), system_prompt="Be brief.")

    def multiply(a: int, b: int) -> int:
        '''Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        '''
        return a * b

    def with_tools():
        return Environment(dataset=[{"question": "6 * 7?", "answer": "42"}], rubric=exact, tools=[multiply])

    def no_prompt():
        return Environment(dataset=[{"problem": "1 + 1", "answer": "2"}], rubric=exact)

    def from_file(file: str):
        return Environment(dataset=file, rubric=exact)

    def too_much(completion: str) -> float:
        return 3.0

    def bad_reward():
        return Environment(dataset=[{"question": "q"}], rubric=too_much)
"""


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "check_env.py"
    path.write_text(textwrap.dedent(ENV))
    return path


def _check(*args: str):
    r = CliRunner().invoke(app, ["env", "check", *args])
    return r, r.output


def _one_line_exit_2(r, output: str, *says: str) -> None:
    assert r.exit_code == 2, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output, output
    for s in says:
        assert s in output, output


def test_a_single_turn_environment_is_summarised_as_a_run_would_train_on_it(env_file):
    r, out = _check("--path", str(env_file), "--args", '{"n": 4}')
    assert r.exit_code == 0, out
    assert f"environment path '{env_file}': loaded, domain 'check_env'" in out
    assert "rows: 4 of dataset, 1 of eval_dataset" in out
    assert "columns: answer, info, level, prompt, question" in out
    assert "system prompt: 'Be brief.'" in out and "rubric: exact (weight 1), length (weight 0)" in out
    assert "multi-turn: no" in out and "sample prompt (task check_env-train-" in out
    assert "  system: Be brief.\n  user: Say 0\n" in out


def test_rows_bounds_what_is_read_and_a_multi_turn_environment_shows_its_tools(env_file):
    r, out = _check("--path", f"{env_file}:load_environment", "--rows", "2")
    assert r.exit_code == 0 and "rows: 2 of dataset (--rows 2), 1 of eval_dataset" in out, out
    r, out = _check("--path", f"{env_file}:with_tools")
    assert r.exit_code == 0, out
    assert "multi-turn: yes, max_turns 4, tool parser hermes, env_response no" in out and "tools: multiply(a, b)" in out
    assert "no eval_dataset (held-out rows are drawn from the dataset)" in out


def test_score_scores_one_completion_against_the_first_row_with_the_rubric(env_file):
    r, out = _check("--path", str(env_file), "--score", " 0 ")
    assert r.exit_code == 0, out
    assert "score of --score against task check_env-train-" in out and ": 1\n" in out
    assert "rewards: exact 1, length None" in out and "metrics: length.chars 3" in out
    r, out = _check("--path", str(env_file), "--score", "7")
    assert r.exit_code == 0 and "rewards: exact 0, length None" in out, out
    r, out = _check("--path", f"{env_file}:bad_reward", "--score", "x")  # the summary, then the one-line error
    assert r.exit_code == 2 and "Traceback" not in out and "rubric: too_much (weight 1)" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("scoring --score against task check_env-train-") and "weighted mean 3 is outside" in last


def test_a_dataset_without_its_prompt_column_is_exit_2_naming_the_column_and_the_columns(env_file, tmp_path):
    r, out = _check("--path", f"{env_file}:no_prompt")
    _one_line_exit_2(r, out, f"environment path '{env_file}:no_prompt'", "has no 'prompt' or 'question' column",
                     "columns: ['answer', 'problem']")
    rows = tmp_path / "rows.jsonl"  # read at the check, not when the environment loads: row 2 is the bad one
    rows.write_text('{"question": "a"}\n{"question": "b"}\n{"text": "c"}\n')
    ref = ["--path", f"{env_file}:from_file", "--args", f'{{"file": "{rows}"}}']
    r, out = _check(*ref)
    _one_line_exit_2(r, out, f"dataset '{rows}' row 2 has no 'prompt' or 'question' column; columns: ['text']")
    r, out = _check(*ref, "--rows", "2")
    assert r.exit_code == 0 and "rows: 2 of dataset (--rows 2)" in out, out


@pytest.mark.parametrize("args, says", [
    (["--path", "{env}:nope"], "has no attribute 'nope'"),
    (["--path", "{dir}/missing.py"], "missing.py' is not a file"),
    (["--module", "no_such_env_module_here"], "module 'no_such_env_module_here' failed to import"),
    (["--id", "no-such-env"], "no installed environment 'no-such-env'"),
    (["--path", "{env}", "--args", '{"m": 1}'], "load_environment(**{'m': 1}) raised TypeError"),
    (["--path", "{env}", "--args", "[1]"], "--args must be a JSON object"),
    (["--path", "{env}", "--args", "{nope"], "--args is not JSON"),
    ([], "give exactly one of --id, --module, --path (got none)"),
    (["--id", "a", "--path", "{env}"], "give exactly one of --id, --module, --path (got --id, --path)"),
])
def test_an_environment_that_cannot_be_checked_is_one_line_and_exit_2(env_file, args, says):
    r, out = _check(*(a.replace("{env}", str(env_file)).replace("{dir}", str(env_file.parent)) for a in args))
    _one_line_exit_2(r, out, says)


def test_a_config_that_does_not_validate_is_one_line_per_error_and_exit_2(tmp_path):
    """``flywheel run`` (and every command that loads a config) names each field at fault, without pydantic's
    traceback, and starts nothing."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(textwrap.dedent("""
        tasks: {kind: none}
        domains:
          mixed: {environment: {module: "x:y"}, generator: "a.b:c"}
          levelled: {environment: {module: "x:y"}, levels: [{difficulty: [0, 1]}, {}]}
        budget: {max_steps: 0}
    """))
    before = signal.getsignal(signal.SIGTERM)
    try:
        r = CliRunner().invoke(app, ["run", str(cfg), "--run-dir", str(tmp_path / "run")])
    finally:
        signal.signal(signal.SIGTERM, before)  # `run` installs its own
    out = r.output
    assert r.exit_code == 2 and "Traceback" not in out and "pydantic" not in out, out
    lines = out.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"invalid config {cfg}: ") for line in lines), out
    assert any("domains.mixed: environment and generator 'a.b:c' are mutually exclusive" in line for line in lines)
    assert any(line.split(": ", 1)[1].startswith("domains.levelled: ") and "difficulty" in line for line in lines)
    assert any(": budget.max_steps: " in line for line in lines), out
    assert not (tmp_path / "run").exists()
    r = CliRunner().invoke(app, ["budget", str(cfg), "--set", "budget.max_steps=x"])
    assert r.exit_code == 2 and "budget.max_steps" in r.output and "Traceback" not in r.output, r.output
