"""The multi-turn tool loop with a real (tiny) model and the real sandbox."""

from __future__ import annotations

import torch

from rollout_service.tool_loop import ToolRunner, run_tool_loop, tool_turn_ids
from rollout_service.torch_engine import TorchEngine
from shared.model import encode_chat
from shared.schemas import SamplingParams, Task
from shared.tools import format_tool_call
from tests.support.taught import teach_tiny_model


def _taught_engine(tmp_path, prompt_msgs, target: str) -> TorchEngine:
    """A tiny random Llama taught (a few dozen supervised steps, under a second) to answer ``prompt_msgs``
    with ``target``: a real model whose greedy first turn is a tool call."""
    tok, model = teach_tiny_model(tmp_path / "tiny", prompt_msgs, target)
    model.eval()
    return TorchEngine(model, tok, seed=0)


async def test_a_tool_call_runs_in_the_sandbox_and_its_result_is_masked(tmp_path, sandbox_url):
    msgs = [{"role": "user", "content": "run it"}]
    call = format_tool_call("run_python", {"code": "print(6*7)"})
    engine = _taught_engine(tmp_path, msgs, call)
    tok = engine.tokenizer
    task = Task(task_id="t", domain="tools", prompt=msgs, verifier={"kind": "regex", "pattern": "42"},
                tools=["run_python"], max_turns=2)
    prompt = encode_chat(tok, msgs)
    runner = ToolRunner(sandbox_url)
    try:
        rollouts = await run_tool_loop(engine, tok, runner, task, prompt, 2,
                                       SamplingParams(max_new_tokens=80, temperature=0.0), max_tokens=400)
    finally:
        await runner.close()
    for r in rollouts:
        assert [t["role"] for t in r.turns] == ["assistant", "tool", "assistant"]
        first, obs, second = r.turns
        assert first["text"] == call and "42" in obs["text"] and obs["tool_calls"][0]["name"] == "run_python"
        # the turns tile the completion: every turn's ids, concatenated, are the final ids
        assert [x for t in r.turns for x in r.ids[t["start"]:t["end"]]] == r.ids
        assert first["start"] == 0 and first["end"] == obs["start"] and obs["end"] == second["start"]
        assert second["end"] == len(r.ids) == len(r.mask) == len(r.logprobs)
        # the observation is the template's tool message after the generated end-of-turn token, never trained
        assert r.ids[obs["start"]:obs["end"]] == tool_turn_ids(tok, obs["text"], tok.decode([tok.eos_token_id]))
        assert r.mask == [1] * first["end"] + [0] * (obs["end"] - obs["start"]) + [1] * (second["end"] - second["start"])
        assert all(lp == 0.0 for lp in r.logprobs[obs["start"]:obs["end"]])
        assert r.tool_rounds == 1 and r.tool_seconds > 0 and r.generated_tokens == first["end"] + second["end"] - second["start"]
        # token in, token out: the second turn's log-probs are those of the model given exactly these ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + r.ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.ids)[:, None])[:, 0]
        s, e = second["start"], second["end"]
        torch.testing.assert_close(torch.tensor(r.logprobs[s:e]), ref[s:e], atol=1e-4, rtol=1e-4)


async def test_unknown_tools_and_malformed_calls_become_observations(sandbox_url):
    task = Task(task_id="t", domain="tools", prompt=[{"role": "user", "content": "x"}],
                verifier={"kind": "regex", "pattern": "."}, tools=["run_python"], max_turns=2)
    runner = ToolRunner(sandbox_url)
    try:
        assert "unknown tool" in await runner.run("rm", {}, task, None)
        assert "malformed" in await runner.run(None, {}, task, "not valid JSON")
        assert "non-empty string argument 'code'" in await runner.run("run_python", {"code": 3}, task, None)
        assert "no tests" in await runner.run("run_tests", {"code": "x=1"}, task.model_copy(
            update={"tools": ["run_tests"]}), None)
        out = await runner.run("run_python", {"code": "import sys; print('hi'); sys.exit(3)"}, task, None)
        assert "hi" in out and "exit code 3" in out
        tested = Task(task_id="u", domain="repair", prompt=[{"role": "user", "content": "x"}], tools=["run_tests"],
                      max_turns=3, verifier={"kind": "unit_tests", "entry_point": "f", "tests": [
                          {"name": "one", "code": "assert f(1) == 2"}, {"name": "two", "code": "assert f(2) == 4"}]})
        out = await runner.run("run_tests", {"code": "def f(x):\n    return x + 1\n"}, tested, None)
        assert "one: passed" in out and "two: failed" in out
    finally:
        await runner.close()


async def test_test_feedback_runs_the_answer_and_the_model_revises_until_it_passes(tmp_path, sandbox_url):
    """``test_feedback``: no tool call needed; a failing answer gets its failures back and a second turn."""
    msgs = [{"role": "user", "content": "f"}]
    wrong = "```python\ndef f(x):\n    return x\n```"
    engine = _taught_engine(tmp_path, msgs, wrong)
    tok = engine.tokenizer
    task = Task(task_id="t", domain="repair", prompt=msgs, tools=["test_feedback"], max_turns=3,
                verifier={"kind": "unit_tests", "entry_point": "f",
                          "tests": [{"name": "double", "code": "assert f(2) == 4"}]})
    runner = ToolRunner(sandbox_url)
    try:
        (r,) = await run_tool_loop(engine, tok, runner, task, encode_chat(tok, msgs), 1,
                                   SamplingParams(max_new_tokens=60, temperature=0.0), max_tokens=600)
    finally:
        await runner.close()
    roles = [t["role"] for t in r.turns]
    assert roles[:3] == ["assistant", "tool", "assistant"] and r.turns[0]["text"] == wrong
    assert "double: failed" in r.turns[1]["text"] and r.turns[1]["tool_calls"][0]["name"] == "run_tests"
    assert r.tool_rounds == len(roles) // 2 >= 1  # observed, then revised (the taught model repeats itself)


async def test_a_tool_call_carries_the_trace_context_to_the_sandbox(sandbox_url, tmp_path_factory):
    """The sandbox's span of a tool call is a child of the caller's span (``traceparent`` on the request),
    in the span store of the sandbox's run directory."""
    import asyncio
    import time

    from opentelemetry.sdk.trace import TracerProvider

    from shared.spans import SpanStore

    task = Task(task_id="t", domain="tools", prompt=[{"role": "user", "content": "x"}],
                verifier={"kind": "regex", "pattern": "."}, tools=["run_python"], max_turns=2)
    runner = ToolRunner(sandbox_url)
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("test")
    try:
        with tracer.start_as_current_span("tool_loop") as span:
            assert "exit code 0" in await runner.run("run_python", {"code": "print(1)"}, task, None)
    finally:
        await runner.close()
    ctx = span.get_span_context()
    deadline = time.monotonic() + 15  # the sandbox writes its spans (and creates the store) about once a second
    while True:
        stores = [SpanStore(p) for p in tmp_path_factory.getbasetemp().glob("sandbox*/traces.sqlite")]
        spans = [s for store in stores for s in store.trace(f"{ctx.trace_id:032x}")]
        if spans or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert {s["name"] for s in spans} >= {"sandbox.execute"}
    assert all(s["service"] == "sandbox" and s["parent_id"] == f"{ctx.span_id:016x}" for s in spans)
