"""The environment API users' code depends on: rubrics, loading by entry point, module and path (with errors
that name what is missing), datasets in the ecosystem's shapes, and the tasks ``flywheel run`` makes of them."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from flywheel.env import (
    DatasetError,
    Environment,
    EnvironmentLoadError,
    EnvironmentRef,
    RewardError,
    Rubric,
    load_environment,
    load_rows,
)
from flywheel.tasks import TaskSourceConfig, make_tasks

ROOT = Path(__file__).resolve().parents[2]
SORT = ROOT / "environments" / "sort_numbers"
CONTEXT = dict(prompt=[], completion="4", answer=4, info={}, state={}, task={}, tool_calls=[])


def test_a_rubric_is_the_weighted_mean_of_the_rewards_that_apply():
    def right(completion, answer):
        return float(completion == str(answer))

    async def half(**kwargs):
        return 0.5

    def skip(info):
        return None

    r = Rubric([right, half, skip], weights=[3, 1, 5]).score(**CONTEXT)
    assert r.score == pytest.approx((3 * 1 + 0.5) / 4) and r.rewards == {"right": 1.0, "half": 0.5, "skip": None}


@pytest.mark.parametrize("value, says", [(float("nan"), "returned nan"), ("1", "returned str"), (True, "bool"),
                                         ({"points": 1}, "without 'score'"), (2.0, "outside [0, 1]"),
                                         (None, "no reward function applied")])
def test_a_bad_reward_value_is_a_reward_error(value, says):
    with pytest.raises(RewardError) as e:
        Rubric([lambda completion: value]).score(**CONTEXT)
    assert says in str(e.value)


def test_a_reward_that_names_an_argument_flywheel_does_not_pass_is_refused_when_built():
    def needs(completion, gold):
        return 1.0

    with pytest.raises(TypeError, match=r"takes \['gold'\]"):
        Rubric([needs])
    with pytest.raises(ValueError, match="2 weights for 1"):
        Rubric([lambda completion: 1.0], weights=[1, 2])


def _write_env(tmp_path: Path, body: str, name: str = "my_env.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
    from flywheel.env import Environment
    def load_environment(k: int = 1):
        return Environment(dataset=[{"question": f"q{i}", "answer": i} for i in range(10 * k)],
                           rubric=lambda completion, answer: float(completion == str(answer)))
    def not_an_env():
        return 42
    def broken():
        raise RuntimeError("no data today")
"""


def test_an_environment_loads_by_path_and_module_with_args(tmp_path, monkeypatch):
    path = _write_env(tmp_path, GOOD)
    assert len(load_environment({"path": str(path), "args": {"k": 2}}).dataset) == 20
    monkeypatch.syspath_prepend(str(tmp_path))
    assert len(load_environment(EnvironmentRef(module="my_env:load_environment")).dataset) == 10


def test_an_installed_entry_point_loads_by_id(tmp_path, monkeypatch):
    """What ``pip install -e`` of a package declaring a ``flywheel.environments`` entry point leaves: a
    dist-info with ``entry_points.txt`` and the code on the path."""
    dist = tmp_path / "flywheel_env_sort_numbers-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flywheel-env-sort-numbers\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text('[flywheel.environments]\nsort-numbers = sort_numbers:load_environment\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(SORT))
    env = load_environment({"id": "sort-numbers", "args": {"n": 7}})
    assert env.name == "sort_numbers" and len(env.dataset) == 7
    with pytest.raises(EnvironmentLoadError, match=r"no installed environment 'sort-numberz'.*sort-numbers"):
        load_environment({"id": "sort-numberz"})


@pytest.mark.parametrize("ref, says", [
    ({"path": "/nonexistent/env.py"}, "'/nonexistent/env.py' is not a file"),
    ({"path": "0" * 4000}, "cannot be read: OSError"),
    ({"module": "no_such_package.envs"}, "module 'no_such_package.envs' failed to import: ModuleNotFoundError"),
    ({"path": "{dir}/my_env.py:missing"}, "has no attribute 'missing'"),
    ({"path": "{dir}/my_env.py:not_an_env"}, "returned int, not a flywheel.env.Environment"),
    ({"path": "{dir}/my_env.py:broken"}, "raised RuntimeError: no data today"),
    ({"path": "{dir}/syntax.py"}, "failed to import: SyntaxError"),
])
def test_an_environment_that_cannot_load_says_which_and_why(tmp_path, ref, says):
    _write_env(tmp_path, GOOD)
    _write_env(tmp_path, "def load_environment(:\n", "syntax.py")
    ref = {k: v.format(dir=tmp_path) if isinstance(v, str) else v for k, v in ref.items()}
    with pytest.raises(EnvironmentLoadError, match=re.escape(says)) as e:
        load_environment(ref)
    assert (ref.get("path") or ref.get("module")).split(":")[0][:100] in str(e.value)


def test_a_reference_names_exactly_one_place():
    with pytest.raises(ValueError, match="exactly one of id, module, path"):
        EnvironmentRef(id="a", path="b.py")
    with pytest.raises(ValueError, match="exactly one"):
        EnvironmentRef()
    assert EnvironmentRef(path="envs/x.py:f").resolved(Path("/base")).path == "/base/envs/x.py:f"


def test_rows_read_from_every_format_in_the_common_shapes(tmp_path):
    rows = [{"question": "2+2", "answer": "4", "info": {"level": 1}}, {"question": "3+3", "answer": "6"}]
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    (tmp_path / "d.json").write_bytes(orjson.dumps(rows))
    (tmp_path / "d.csv").write_text("question,answer\n2+2,4\n3+3,6\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    verl = [{"data_source": "gsm", "prompt": [{"role": "user", "content": "2+2"}],
             "reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": 0}}]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "verl.parquet")
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list([{"problem": "2+2", "solution": "4"}])}).save_to_disk(tmp_path / "hf")
    for name in ("d.jsonl", "d.json", "d.csv"):
        got = load_rows(tmp_path / name)
        assert [r["prompt"] for r in got] == [[{"role": "user", "content": "2+2"}], [{"role": "user", "content": "3+3"}]]
        assert [r["answer"] for r in got] == ["4", "6"]
    assert load_rows(tmp_path / "d.jsonl")[0]["info"] == {"level": 1}
    v = load_rows(tmp_path / "verl.parquet")[0]
    assert v["answer"] == "4" and v["info"] == {"index": 0} and v["data_source"] == "gsm"
    hf = load_rows(tmp_path / "hf", columns={"question": "problem", "answer": "solution"})
    assert hf[0]["prompt"][0]["content"] == "2+2" and hf[0]["answer"] == "4"


def test_a_row_without_its_column_is_named(tmp_path):
    with pytest.raises(DatasetError, match=r"row 1 has no 'prompt' or 'question' column; columns: \['query'\]"):
        load_rows([{"question": "a"}, {"query": "b"}])
    with pytest.raises(DatasetError, match=r"has no column 'solution' \(mapped to 'answer'\)"):
        load_rows([{"question": "a"}], columns={"answer": "solution"})
    with pytest.raises(DatasetError, match="unknown format '.txt'"):
        (tmp_path / "d.txt").write_text("x")
        load_rows(tmp_path / "d.txt")


def test_a_null_prompt_column_falls_back_to_the_question_and_both_missing_are_named():
    assert load_rows([{"prompt": None, "question": "q"}])[0]["prompt"] == [{"role": "user", "content": "q"}]
    with pytest.raises(DatasetError, match=r"row 0 has no 'prompt' or 'question' column \('prompt' empty\); "
                                           r"columns: \['answer', 'prompt'\]"):
        load_rows([{"prompt": None, "answer": 1}])
    with pytest.raises(DatasetError, match=r"row 0 has no column 'problem' \(mapped to 'question'\); "
                                           r"columns: \['answer', 'text'\]"):
        load_rows([{"text": "a", "answer": 1}], columns={"question": "problem"})


def test_a_row_becomes_the_same_task_for_the_driver_and_the_scheduler(tmp_path):
    """``shared.envs.tasks`` is the one place rows become tasks: the driver's ``tasks.kind: environment`` and
    an environment domain of the scheduler make the same tasks of the same rows (same seed, same domain name)."""
    from scheduler_service.config import DomainConfig
    from scheduler_service.generate import make_tasks as domain_tasks

    path = _write_env(tmp_path, GOOD)
    driver = make_tasks(TaskSourceConfig(kind="environment", environment={"path": str(path)}, train_size=100,
                                         eval_size=3, samples_per_task=4))
    cfg = DomainConfig(environment={"path": str(path)}, eval_size=3, tasks_per_level=100, samples_per_task=4)
    from shared.schemas import Task

    scheduler = [t for split in ("eval", "train") for t in domain_tasks("my_env", cfg, 0, 100, split, 0)]
    assert len(scheduler) == 10 and scheduler == [Task(**t) for t in driver]


def test_flywheel_run_makes_held_out_and_training_tasks_of_an_environment(tmp_path):
    path = _write_env(tmp_path, GOOD)
    tasks = make_tasks(TaskSourceConfig(kind="environment", environment={"path": str(path)}, train_size=100,
                                        eval_size=3, samples_per_task=4))
    held = [t for t in tasks if t["split"] == "eval"]
    train = [t for t in tasks if t["split"] == "train"]
    assert len(held) == 3 and len(train) == 7 and {t["domain"] for t in tasks} == {"my_env"}
    assert not {t["prompt"][-1]["content"] for t in held} & {t["prompt"][-1]["content"] for t in train}
    v = train[0]["verifier"]
    assert v["kind"] == "environment" and v["environment"]["path"] == str(path) and isinstance(v["answer"], int)
    from shared.schemas import Task

    Task(**train[0])  # what POST /v1/tasks accepts


def test_the_public_module_loads_no_other_driver_module():
    """Services import users' environments, and users' code imports ``flywheel.env``: it must not pull in the
    driver (the CLI, the launcher)."""
    code = "import sys, flywheel.env; print(sorted(m for m in sys.modules if m.split('.')[0] == 'flywheel'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['flywheel', 'flywheel.env']"


def test_the_shipped_single_turn_example_is_short_and_scores():
    assert len((SORT / "sort_numbers.py").read_text().splitlines()) <= 40
    sys.path.insert(0, str(SORT))
    try:
        env = load_environment({"module": "sort_numbers", "args": {"n": 5}})
    finally:
        sys.path.remove(str(SORT))
    assert isinstance(env, Environment) and len(env.dataset) == 5
    assert env.rubric.score(**{**CONTEXT, "completion": "1, 2, 3", "answer": [1, 2, 3]}).score == 1.0


def test_the_llama3_json_parser_reads_bare_calls_and_flags_bad_ones():
    from shared.tools import parse_llama3_json_calls

    (call,) = parse_llama3_json_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}')
    assert (call.name, call.arguments, call.error) == ("add", {"a": 1}, None)
    assert [c.name for c in parse_llama3_json_calls('{"name": "a", "parameters": {}}; {"name": "b", '
                                                    '"arguments": {}}')] == ["a", "b"]
    assert parse_llama3_json_calls("The answer is 5") == []
    assert "not valid JSON" in parse_llama3_json_calls('{"name": "add", "parameters": {"a": 1,}}')[0].error
    assert parse_llama3_json_calls('{"foo": 1}')[0].error == "no string 'name'"
    with pytest.raises(ValueError, match="unknown tool_parser 'xml'"):
        Environment(dataset=[], rubric=lambda completion: 1.0, tool_parser="xml")


def test_a_dataset_list_without_its_prompt_column_is_refused_when_the_environment_loads(tmp_path):
    """Its first row is checked when the environment is built (a path is not opened: it is read at the run)."""
    path = _write_env(tmp_path, """
        from flywheel.env import Environment
        def no_prompt():
            return Environment(dataset=[{"problem": "1+1", "answer": 2}], rubric=lambda completion: 1.0)
        def bad_eval():
            return Environment(dataset=[{"question": "1+1"}], eval_dataset=[{"text": "2+2"}],
                               rubric=lambda completion: 1.0)
        def mapped():
            return Environment(dataset=[{"problem": "1+1"}], columns={"question": "problem"},
                               rubric=lambda completion: 1.0)
        def from_file():
            return Environment(dataset="no/such/rows.jsonl", rubric=lambda completion: 1.0)
    """)
    with pytest.raises(EnvironmentLoadError, match=re.escape(
            f"environment path '{path}:no_prompt': dataset row 0 has no 'prompt' or 'question' column; "
            "columns: ['answer', 'problem']")):
        load_environment({"path": f"{path}:no_prompt"})
    with pytest.raises(EnvironmentLoadError, match=re.escape("eval_dataset row 0 has no 'prompt' or 'question' "
                                                             "column; columns: ['text']")):
        load_environment({"path": f"{path}:bad_eval"})
    assert load_environment({"path": f"{path}:mapped"}).columns == {"question": "problem"}
    assert load_environment({"path": f"{path}:from_file"}).dataset == "no/such/rows.jsonl"  # not opened here


@pytest.mark.parametrize("rows, eval_size, says", [
    (20, 30, "tasks.eval_size 30 asked for more held-out rows than the dataset's 20 rows"),
    (20, 20, "tasks.eval_size 20 holds out 20 rows"),
])
def test_no_training_row_left_names_the_eval_size_asked_and_the_rows_there(tmp_path, rows, eval_size, says):
    path = _write_env(tmp_path, GOOD)
    with pytest.raises(ValueError, match=re.escape(f"environment 'my_env': no training rows left: {says}")):
        make_tasks(TaskSourceConfig(kind="environment", environment={"path": str(path), "args": {"k": rows // 10}},
                                    train_size=100, eval_size=eval_size, samples_per_task=4))


def test_the_retry_environment_pays_less_for_each_extra_answer():
    """environments/arithmetic_retry: a wrong answer gets the retry prompt, a right one ends the rollout; the reward
    is 1, 1/2, 1/4 for a right first, second, third answer, and an unchecked last answer (out of turns) counts."""
    env = load_environment({"path": str(ROOT / "environments" / "arithmetic_retry" / "arithmetic_retry.py")})
    assert len(env.dataset) == 200 and len({r["question"] for r in env.dataset}) == 200 and env.max_turns == 3
    mod = sys.modules[env.env_response.__module__]

    def play(answers: list[str], answer: int, checked: int) -> tuple[float, dict]:
        state: dict = {}
        mod.setup(state, answer)
        said = [env.env_response(a, state) for a in answers[:checked]]
        assert said[:-1] == [mod.RETRY] * (len(said) - 1)
        return env.rubric.score(**{**CONTEXT, "completion": answers[-1], "answer": answer, "state": state}).score, state

    assert play(["-3"], -3, 1)[0] == 1.0
    assert play(["5", "7 - 3 = 4"], 4, 2)[0] == 0.5 and play(["1", "2", "3"], 3, 2)[0] == 0.25  # the third unchecked
    score, state = play(["1", "2", "5"], 3, 2)
    assert score == 0.0 and state["answers"] == [1, 2]
    assert play(["The answer is", "It is 12"], 12, 1)[0] == 0.5  # no number at first: a wrong answer
