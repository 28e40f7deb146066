"""A user environment's loop in the rollout, with a real (tiny, taught) model: Python tools with injected state,
``env_response`` turns, ``setup``/``cleanup``, and the failures the model sees (a tool that raises, hangs, an
unknown tool, malformed JSON) or that make an error sample (a hook that raises)."""

from __future__ import annotations

import asyncio
import pytest

from rollout_service.env_loop import encode_with_tools, run_env_loop
from rollout_service.tool_loop import tool_turn_ids
from rollout_service.torch_engine import TorchEngine
from shared.envs import Environment
from shared.schemas import SamplingParams, Task
from shared.tools import format_tool_call
from tests.support.taught import teach_tiny_mixture

GREEDY = SamplingParams(max_new_tokens=150, temperature=0.0)


def add(a: int, b: int, state: dict) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    state.setdefault("calls", []).append([a, b])
    return a + b


def slow(a: int) -> int:
    """Sleep, then answer.

    Args:
        a: anything
    """
    import time

    time.sleep(3)  # past the test's 0.5 s timeout; its thread then ends on its own
    return a


def broken(a: int) -> int:
    """Fail.

    Args:
        a: anything
    """
    raise ValueError("no such account")


TOOLS = [add, broken, slow]
ANSWERS = {
    "add": format_tool_call("add", {"a": 2, "b": 3}),
    "broken": format_tool_call("broken", {"a": 1}),
    "slow": format_tool_call("slow", {"a": 1}),
    "unknown": format_tool_call("sub", {"a": 1}),
    "missing": format_tool_call("add", {"a": 1}),
    "malformed": '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
    "guess": "50",
    "llama": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
}
"""What the taught model answers to the user message ``case <key>`` (every case's prompt lists the same tools)."""


def _msgs(case: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"case {case}"}]


TOOLS_TEMPLATE = ("{% if tools %}t:{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
                  "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}a:{% endif %}")
"""The tiny model's chat template, plus the tools by name: a template that renders ``tools=`` (so prompts stay
short and the model is taught in seconds; the other path, tools described in the system message, has its own
test below)."""


def _render(tok, msgs):
    tok.chat_template = TOOLS_TEMPLATE
    tools = [] if msgs == _msgs("guess") else _env().tool_schemas()  # the guessing game has no tools
    return encode_with_tools(tok, msgs, tools)


def _env(**kw) -> Environment:
    return Environment(dataset=[], rubric=lambda completion: 1.0, tools=TOOLS, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> TorchEngine:
    """One tiny model taught every case's answer (a few seconds), shared by the module's tests."""
    tok, model = teach_tiny_mixture(tmp_path_factory.mktemp("tiny") / "model",
                                    [(_msgs(k), v, 1.0) for k, v in ANSWERS.items()], steps=200,
                                    render=_render)
    model.eval()
    return TorchEngine(model, tok, seed=0)


async def _run(engine, env, case, n=2):
    msgs = _msgs(case)
    task = Task(task_id="t", domain="env", prompt=msgs, max_turns=env.max_turns,
                verifier={"kind": "environment", "environment": {"module": "unused"}, "answer": 5})
    prompt = encode_with_tools(engine.tokenizer, msgs, env.tool_schemas())
    return await run_env_loop(engine, engine.tokenizer, env, task, prompt, n, GREEDY, max_tokens=1200)


async def test_a_python_tool_runs_with_the_rollouts_state_and_its_result_is_masked(engine):
    cleaned = []
    env = _env(max_turns=2, setup=lambda state, answer: state.update(gold=answer),
               cleanup=lambda state: cleaned.append(dict(state)))
    runs = await _run(engine, env, "add")
    tok = engine.tokenizer
    for ro in runs:
        r = ro.rollout
        assert ro.error is None and [t["role"] for t in r.turns] == ["assistant", "tool", "assistant"]
        first, obs, second = r.turns
        assert first["text"] == ANSWERS["add"] and obs["text"] == "5" and obs["tool_calls"][0]["name"] == "add"
        assert r.ids[obs["start"]:obs["end"]] == tool_turn_ids(tok, "5", tok.decode([tok.eos_token_id]))
        assert r.mask[obs["start"]:obs["end"]] == [0] * (obs["end"] - obs["start"]) and sum(r.mask) == r.generated_tokens
        assert ro.state == {"gold": 5, "calls": [[2, 3]]} and ro.state_record() == ro.state
    assert len(cleaned) == 2  # cleanup ran once per rollout


@pytest.mark.parametrize("case, says", [
    ("broken", "error: broken raised ValueError: no such account"),
    ("slow", "error: slow did not finish within 0.5 s"),
    ("unknown", "error: unknown tool 'sub'; available: ['add', 'broken', 'slow']"),
    ("missing", "error: add needs argument(s) ['b']"),
    ("malformed", "error: malformed tool call"),
])
async def test_a_failing_call_is_an_observation_the_model_reads(engine, case, says):
    (ro,) = await _run(engine, _env(max_turns=2, hook_timeout_s=0.5), case, n=1)
    assert ro.error is None and ro.rollout.turns[0]["text"] == ANSWERS[case]
    assert ro.rollout.turns[1]["role"] == "tool" and ro.rollout.turns[1]["text"].startswith(says), ro.rollout.turns


async def test_the_llama3_json_parser_reads_a_bare_call_and_hermes_does_not(engine):
    (ro,) = await _run(engine, _env(max_turns=2, tool_parser="llama3_json"), "llama", n=1)
    assert [t["role"] for t in ro.rollout.turns][:2] == ["assistant", "tool"] and ro.rollout.turns[1]["text"] == "5"
    (ro,) = await _run(engine, _env(max_turns=2), "llama", n=1)  # hermes: a bare object is an answer, not a call
    assert [t["role"] for t in ro.rollout.turns] == ["assistant"]


async def test_env_response_answers_turns_without_a_call_until_it_returns_none(engine):
    seen = []

    async def env_response(completion: str, turn: int, state: dict) -> str | None:
        await asyncio.sleep(0)
        seen.append(turn)
        state["guesses"] = turn
        return "Too low. Guess again." if turn < 2 else None

    env = Environment(dataset=[], rubric=lambda completion: 1.0, env_response=env_response, max_turns=5)
    (ro,) = await _run(engine, env, "guess", n=1)
    assert ro.rollout.turns[0]["text"] == "50"
    assert [t["role"] for t in ro.rollout.turns] == ["assistant", "user", "assistant"]
    assert ro.rollout.turns[1]["text"] == "Too low. Guess again." and seen == [1, 2] and ro.state == {"guesses": 2}
    tok = engine.tokenizer
    obs = ro.rollout.turns[1]
    assert ro.rollout.ids[obs["start"]:obs["end"]] == tool_turn_ids(tok, obs["text"], tok.decode([tok.eos_token_id]),
                                                                     "user")


async def test_a_hook_that_raises_makes_an_error_sample_and_cleanup_still_runs(engine):
    cleaned = []

    def setup(state):
        raise RuntimeError("database down")

    runs = await _run(engine, _env(setup=setup, cleanup=lambda state: cleaned.append(1)), "add", n=2)
    assert all(ro.error == "environment hook setup raised RuntimeError: database down" for ro in runs)
    assert all(ro.rollout.ids == [] for ro in runs) and cleaned == [1, 1]


def test_tools_are_described_by_the_template_or_else_in_the_system_message(tmp_path):
    """The tiny model's template renders no tools: they go into the system message with the call format; a
    template that renders ``tools=`` (here: one that prints them) is used as it is."""
    from shared.model import build_tiny_model, load_tokenizer

    tok = load_tokenizer(build_tiny_model(tmp_path / "tiny"))
    schemas = Environment(dataset=[], rubric=lambda completion: 1.0, tools=[add]).tool_schemas()
    text = tok.decode(encode_with_tools(tok, [{"role": "system", "content": "Be brief."}, *_msgs("add")], schemas))
    assert "Be brief." in text and '"name":"add"' in text and "<tool_call>" in text
    tok.chat_template = ("{% if tools %}{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    text = tok.decode(encode_with_tools(tok, _msgs("add"), schemas))
    assert text.startswith("TOOL add") and "<tool_call>" not in text
