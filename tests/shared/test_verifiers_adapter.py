"""Environments written for the ``verifiers`` library (its classic API, the pinned release of the extra
``flywheel[verifiers]``) load as Flywheel environments: the same rows, the same rewards as verifiers' own
``Rubric.score_rollout`` computes for the same completions, tools with verifiers' schemas, a MultiTurnEnv's
loop as Flywheel hooks, and a clear refusal of the shapes Flywheel cannot run."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import textwrap
import threading
from pathlib import Path

import pytest

from flywheel.env import EnvironmentLoadError, RewardError, load_environment
from flywheel.tasks import TaskSourceConfig, make_tasks
from shared.envs.tools import call_tool
from shared.schemas import Task

vf = pytest.importorskip("verifiers", reason="the extra flywheel[verifiers] is not installed")

MATH = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 12):
    """As the verifiers docs write one: a dataset of question/answer/info, a parser, a weighted rubric."""
    parser = vf.XMLParser(["answer"], answer_field="answer")
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "info": {"level": i % 3}}
            for i in range(n)]

    def correct_answer(completion, answer, parser) -> float:
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    async def brevity(completion, info) -> float:
        return 1.0 / (1 + len(completion[-1]["content"]) // 20) + 0.0 * info["level"]

    rubric = vf.Rubric(funcs=[correct_answer, brevity, parser.get_format_reward_func()], weights=[0.75, 0.25, 0.0],
                       parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Answer inside <answer></answer>.",
                            parser=parser, rubric=rubric)
'''

TOOLS = '''
import verifiers as vf
from datasets import Dataset


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


async def lookup(key: str) -> str:
    """Look a key up in the table.

    Args:
        key: the key to find
    """
    return {"pi": "3.14"}[key]


def load_environment():
    rows = [{"question": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(6)]

    def correct(completion, answer, parser) -> float:
        return float(parser.parse_answer(completion) == answer)

    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[multiply, lookup], max_turns=3,
                      rubric=vf.Rubric(funcs=[correct]))
'''

GAME = '''
import verifiers as vf
from datasets import Dataset


class Guess(vf.MultiTurnEnv):
    async def setup_state(self, state):
        state["guesses"] = []

    async def env_response(self, messages, state, **kwargs):
        guess = int(messages[-1].content.strip() or 0)
        state["guesses"].append(guess)
        return [vf.UserMessage(content="Higher." if guess < int(state["answer"]) else "Lower.")]

    @vf.stop
    async def found(self, state) -> bool:
        last = state["trajectory"][-1]["completion"][-1].content if state["trajectory"] else ""
        return last.strip() == state["answer"]


def load_environment():
    rows = [{"question": "Guess my number from 1 to 9.", "answer": str(i)} for i in range(1, 7)]

    def won(completion, answer) -> float:
        return float(completion[-1]["content"].strip() == answer)

    def guesses(state) -> float:
        return float(len(state["guesses"]))

    return Guess(dataset=Dataset.from_list(rows), max_turns=4, rubric=vf.Rubric(funcs=[won, guesses], weights=[1, 0]))
'''


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def _verifiers_env(path: Path):
    """The same environment built by the file's own function, outside Flywheel: the reference."""
    spec = importlib.util.spec_from_file_location(f"reference_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load_environment()


async def _verifiers_score(vf_env, row: dict, completion: list) -> tuple[float, dict]:
    """verifiers' own scoring of ``completion`` (messages) for ``row``: its ``init_state`` (with a client that is
    never called), one trajectory step per assistant message, its ``render_completion``, its ``score_rollout``."""
    from openai import AsyncOpenAI
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    client = OpenAIChatCompletionsClient(AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1"))
    state = await vf_env.init_state(dict(row), client, "unused")
    messages = list(state["prompt"])
    for m in completion:
        if m.role == "assistant":
            state["trajectory"].append({"prompt": list(messages), "completion": [m], "response": None, "tokens": None,
                                        "reward": None, "advantage": None, "is_truncated": False,
                                        "trajectory_id": state["trajectory_id"], "extras": {}})
        messages.append(m)
    await vf_env.render_completion(state)
    await vf_env.rubric.score_rollout(state)
    return state["reward"], state["metrics"]


def _context(task: Task, completion: str, rollout: dict | None = None) -> dict:
    """What the verifier service passes an environment's rubric (verifier_service/environments.py)."""
    spec = task.verifier
    return {"prompt": [m.model_dump() for m in task.prompt], "completion": completion, "answer": spec.answer,
            "info": spec.info, "state": {}, "tool_calls": [], "turns": [], "task": spec.task, **(rollout or {})}


def test_a_single_turn_env_loads_with_its_rows_and_scores_as_its_own_rubric(tmp_path):
    path = _write(tmp_path, "vf_math", MATH)
    env = load_environment({"path": str(path)})
    vf_env = _verifiers_env(path)
    assert not env.multi_turn and env.max_turns == 1 and env.system_prompt == vf_env.system_prompt
    rows = {r["example_id"]: r for r in vf_env.get_dataset()}
    tasks = [Task(**t) for t in make_tasks(TaskSourceConfig(kind="environment", environment={"path": str(path)},
                                                            train_size=100, eval_size=2, samples_per_task=4))]
    assert len(tasks) == 12 and {t.domain for t in tasks} == {"vf_math"}
    for task in tasks[:4]:
        row = rows[task.verifier.row["example_id"]]
        assert [m.model_dump() for m in task.prompt] == [{"role": m["role"], "content": m["content"]}
                                                         for m in row["prompt"]]
        assert task.verifier.answer == row["answer"] and task.verifier.info == row["info"]
        for text in (f"<answer>{row['answer']}</answer>", "<answer>0</answer>", f"It is {row['answer']}.",
                     "<answer>\n" + row["answer"] + "\n</answer> since adding the two gives that sum"):
            got = env.rubric.score(**_context(task, text))
            want, metrics = asyncio.run(_verifiers_score(vf_env, row, [vf.AssistantMessage(content=text)]))
            assert got.score == pytest.approx(want), (text, got, metrics)
            assert got.metrics == pytest.approx({f"verifiers_rubric.{k}": v for k, v in metrics.items()})
    assert {"correct_answer", "brevity", "format_reward_func", "num_turns"} == set(metrics)


def test_a_tool_env_loads_its_tools_with_their_schemas_and_scores_tool_rollouts_as_verifiers(tmp_path):
    path = _write(tmp_path, "vf_tools", TOOLS)
    env = load_environment({"path": str(path)})
    vf_env = _verifiers_env(path)
    assert env.multi_turn and env.max_turns == 3 and [t.__name__ for t in env.tools] == ["multiply", "lookup"]
    assert env.tool_schemas() == [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                    "parameters": t.parameters}}
                                  for t in vf_env.tool_defs]
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["a", "b"]

    async def call(name, arguments):
        return await call_tool(env.tools, name, arguments, None, {"state": {}, "task": {}}, 5.0)

    assert asyncio.run(call("multiply", {"a": 6, "b": 7})) == "42"
    assert asyncio.run(call("lookup", {"key": "pi"})) == "3.14"
    assert asyncio.run(call("lookup", {"key": "e"})) == "'e'"  # verifiers' error_formatter: f"{e}"

    task = next(Task(**t) for t in make_tasks(TaskSourceConfig(
        kind="environment", environment={"path": str(path)}, train_size=100, eval_size=0, samples_per_task=4)))
    row = next(r for r in vf_env.get_dataset() if r["example_id"] == task.verifier.row["example_id"])
    first = 'Let me compute.<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 7}}</tool_call>'
    turns = [{"role": "assistant", "text": first}, {"role": "tool", "text": "21"},
             {"role": "assistant", "text": row["answer"]}]
    got = env.rubric.score(**_context(task, row["answer"], {"turns": turns, "tool_calls": [
        {"name": "multiply", "arguments": {"a": 3, "b": 7}, "error": None}]}))
    completion = [vf.AssistantMessage(content="Let me compute.", tool_calls=[
                      vf.ToolCall(id="call_0_0", name="multiply", arguments='{"a": 3, "b": 7}')]),
                  vf.ToolMessage(content="21", tool_call_id="call_0_0"), vf.AssistantMessage(content=row["answer"])]
    want, metrics = asyncio.run(_verifiers_score(vf_env, row, completion))
    assert got.score == pytest.approx(want) and metrics["multiply_calls"] == 1 and metrics["total_tool_calls"] == 1
    assert got.metrics == pytest.approx({f"verifiers_rubric.{k}": v for k, v in metrics.items()})


def test_a_multi_turn_env_runs_its_env_response_and_stop_conditions_as_flywheel_hooks(tmp_path):
    path = _write(tmp_path, "vf_game", GAME)
    env = load_environment({"path": str(path)})
    assert env.multi_turn and env.max_turns == 4 and not env.tools
    task = next(Task(**t) for t in make_tasks(TaskSourceConfig(
        kind="environment", environment={"path": str(path)}, train_size=100, eval_size=0, samples_per_task=4)))
    answer = int(task.verifier.answer)
    ctx = {"task": task.verifier.task, "prompt": [m.model_dump() for m in task.prompt],
           "answer": task.verifier.answer, "info": task.verifier.info}

    async def play(guesses: list[int]) -> tuple[dict, list]:
        state: dict = {}
        await env.setup(state=state, **ctx)
        replies = [await env.env_response(completion=str(g), state=state) for g in guesses]
        await env.cleanup(state=state)
        return state, replies

    state, replies = asyncio.run(play([answer - 1, answer + 1, answer]))
    assert replies == ["Higher.", "Lower.", None] and state["guesses"] == [answer - 1, answer + 1]
    turns = [t for g, r in zip([answer - 1, answer + 1, answer], replies)
             for t in [{"role": "assistant", "text": str(g)}] + ([{"role": "user", "text": r}] if r else [])]
    got = env.rubric.score(**_context(task, str(answer), {"state": state, "turns": turns}))
    assert got.score == 1.0 and got.metrics["verifiers_rubric.guesses"] == 2
    assert got.metrics["verifiers_rubric.num_turns"] == 3


UNSUPPORTED = {
    "group reward": ('def completion_lengths(completions) -> list[float]:\n    return [1.0] * len(completions)\n\n'
                     'ENV = vf.SingleTurnEnv(dataset=DATA, rubric=vf.Rubric(funcs=[completion_lengths]))',
                     "group reward function 'completion_lengths'"),
    "stateful tools": ('class Env(vf.StatefulToolEnv):\n    def update_tool_args(self, tool_name, tool_args, messages, '
                       'state, **kwargs):\n        return tool_args\n\nENV = Env(dataset=DATA, tools=[])',
                       "a ToolEnv overriding ['env_response']"),
    "a parser": ("ENV = vf.XMLParser(['answer'])", "only SingleTurnEnv, ToolEnv and MultiTurnEnv"),
}


@pytest.mark.parametrize("shape", sorted(UNSUPPORTED))
def test_a_shape_flywheel_cannot_run_is_refused_naming_it(tmp_path, shape):
    body, says = UNSUPPORTED[shape]
    source = ("import verifiers as vf\nfrom datasets import Dataset\n\nDATA = Dataset.from_list([{'question': 'q', "
              f"'answer': 'a'}}])\n\n{body}\n\n\ndef load_environment():\n    return ENV\n")
    path = _write(tmp_path, "vf_bad_" + shape.replace(" ", "_"), source)
    with pytest.raises(EnvironmentLoadError) as e:
        load_environment({"path": str(path)})
    assert says in str(e.value) and str(path) in str(e.value) and "docs/guides/verifiers.md" in str(e.value)


def test_a_reward_that_raises_or_leaves_0_to_1_is_a_reward_error_not_a_silent_score(tmp_path):
    source = MATH.replace("weights=[0.75, 0.25, 0.0]", "weights=[1.0, 1.0, 0.0]")
    path = _write(tmp_path, "vf_math_sum", source)
    env = load_environment({"path": str(path)})
    task = next(Task(**t) for t in make_tasks(TaskSourceConfig(
        kind="environment", environment={"path": str(path)}, train_size=100, eval_size=0, samples_per_task=4)))
    with pytest.raises(RewardError, match="outside"):  # verifiers' reward is a weighted sum: 2.0 here
        env.rubric.score(**_context(task, f"<answer>{task.verifier.answer}</answer>"))
    with pytest.raises(RewardError, match="verifiers reward 'brevity' raised KeyError"):
        env.rubric.score(**{**_context(task, "<answer>1</answer>"), "info": {}})


def test_weights_adding_to_more_than_1_are_a_warning_at_load_and_the_error_names_the_weighted_sum(tmp_path, caplog):
    """verifiers' score is the weighted sum of its functions: weights adding to 2 are said when the environment
    loads, and a rollout scoring 2 is refused in those words (the sum, the weights, the values), not as a mean."""
    path = _write(tmp_path, "vf_math_weights", MATH.replace("weights=[0.75, 0.25, 0.0]", "weights=[1.0, 1.0, 0.0]"))
    with caplog.at_level("WARNING", logger="shared.envs.verifiers_adapter"):
        env = load_environment({"path": str(path)})
    [warning] = [r.getMessage() for r in caplog.records if r.name == "shared.envs.verifiers_adapter"]
    assert "'correct_answer': 1.0, 'brevity': 1.0" in warning and "add to 2," in warning, warning
    task = next(Task(**t) for t in make_tasks(TaskSourceConfig(
        kind="environment", environment={"path": str(path)}, train_size=100, eval_size=0, samples_per_task=4)))
    with pytest.raises(RewardError, match=r"verifiers rubric's weighted sum 2 \(Σ weight · value; weights "
                                          r"\{'correct_answer': 1.0, 'brevity': 1.0") as e:
        env.rubric.score(**_context(task, f"<answer>{task.verifier.answer}</answer>"))
    assert "mean" not in str(e.value)
    from typer.testing import CliRunner

    from flywheel.cli import app

    r = CliRunner().invoke(app, ["env", "check", "--path", str(path), "--score", "<answer>1</answer>"])  # row 0's
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert ("verifiers rubric: weighted sum of correct_answer (weight 1), brevity (weight 1)" in r.output
            and "weights add to 2" in r.output), r.output
    assert "the verifiers rubric's weighted sum 2 " in r.output.strip().splitlines()[-1], r.output
    caplog.clear()
    with caplog.at_level("WARNING", logger="shared.envs.verifiers_adapter"):
        load_environment({"path": str(_write(tmp_path, "vf_math_ok", MATH))})  # 0.75 + 0.25 + 0: no warning
    assert not [r for r in caplog.records if r.name == "shared.envs.verifiers_adapter"]


def test_loading_keeps_the_process_signal_handlers_and_works_off_the_main_thread(tmp_path):
    """verifiers' environments install SIGINT/SIGTERM handlers when built (and cannot be built off the main
    thread for it); the scheduler loads environments in a worker thread and the services own their signals."""
    path = _write(tmp_path, "vf_math_thread", MATH)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    out: list = []
    thread = threading.Thread(target=lambda: out.append(load_environment({"path": str(path)})))
    thread.start()
    thread.join(120)
    assert len(out) == 1 and len(out[0].dataset) == 12
    load_environment({"path": str(path)})
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
