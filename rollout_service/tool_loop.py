"""The multi-turn execute–observe–revise loop: the model calls tools, the sandbox runs them, the model
reads the result and goes on, until a final answer, the turn limit or the token budget.

Token-in/token-out: each turn appends to the ids of the turns before it, never re-encoding them.
A tool result enters as the chat template's own tokens for a ``tool`` message plus the next
assistant header, taken as the template's text *after* the end-of-turn token the model generated
(:func:`tool_turn_ids`), with ``loss_mask`` 0 and log-prob 0 (the policy did not produce them).

Tools (``Task.tools`` names which the model may call; the format is ``shared.tools``):

* ``run_python`` ``{"code": str}``: runs the code in the sandbox; the observation is the exit status,
  stdout and stderr (clipped).
* ``run_tests`` ``{"code": str}``: runs the code against the task's ``unit_tests`` spec in the sandbox's
  test-harness mode; the observation is each test's status and message.
* ``test_feedback`` (not called by the model): the environment runs the tests on the code of every
  answer that makes no tool call; when some fail, their results are the observation and the model
  revises (until all pass or the turns run out). Small models that never write a tool call still get
  the execute-observe-revise loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from opentelemetry import propagate

from rollout_service.engine import Engine, EngineGate, GenerationRequest
from shared.auth import token_from_run_dir
from shared.client import SANDBOX_RETRY_S, AsyncApiClient, RetryPolicy, Token
from shared.schemas import SamplingParams, Task, VersionSpan
from shared.text import extract_code
from shared.tools import ToolCall, parse_tool_calls

OBSERVATION_CHARS = 2000
"""Longest tool result shown to the model (characters); longer ones are cut in the middle."""
TOOLS = ("run_python", "run_tests")
FEEDBACK = "test_feedback"
ALL_PASSED = "all tests passed"


def tool_turn_ids(tokenizer, result: str, eos_text: str | None, role: str = "tool") -> list[int]:
    """Token ids that follow an assistant turn ending in the end-of-turn token ``eos_text``: the chat
    template's ``role`` message (``tool``, or ``user`` for an environment's reply) holding ``result`` and the
    next assistant header.

    Raises:
        ValueError: the chat template does not render such a message after an assistant message.
    """
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
    a = tokenizer.apply_chat_template(base, tokenize=False)
    b = tokenizer.apply_chat_template(base + [{"role": role, "content": result}], tokenize=False,
                                      add_generation_prompt=True)
    cut = a.find("\x00") + 1
    if cut == 0 or not b.startswith(a[:cut]):
        raise ValueError(f"the chat template does not extend an assistant turn with a {role} message")
    if eos_text and a[cut:].startswith(eos_text):
        cut += len(eos_text)  # the model generated this token itself
    return tokenizer(b[cut:], add_special_tokens=False)["input_ids"]


def _clip_middle(text: str, n: int = OBSERVATION_CHARS) -> str:
    return text if len(text) <= n else text[: n // 2] + "\n...[cut]...\n" + text[-n // 2:]


class ToolRunner:
    """Executes tool calls in the sandbox service over HTTP, with the system's bearer token.

    One call is bounded by ``timeout_s + 30`` seconds in all; a refused connection (the sandbox restarting)
    and HTTP 503 (it admits no execution now) are retried with backoff for up to ``SANDBOX_RETRY_S``
    (``shared.client``); a timeout after the request was sent is not (the program would run twice).

    Args:
        sandbox_url: the sandbox's base URL.
        timeout_s: the program's time limit in the sandbox (seconds).
        token: the token, or a function returning it; None: ``$FLYWHEEL_AUTH__TOKEN``, else the file
            ``$FLYWHEEL_AUTH__TOKEN_FILE`` (the launcher sets it; relative to the working directory, the run
            dir), read at each call until found.
    """

    def __init__(self, sandbox_url: str, timeout_s: float = 10.0, token: Token = None) -> None:
        self.timeout_s = timeout_s
        self.http = AsyncApiClient(sandbox_url, token if token is not None else (lambda: token_from_run_dir(None)),
                                   timeout=httpx.Timeout(timeout_s + 30.0, connect=5.0),
                                   retry=RetryPolicy(deadline_s=timeout_s + 30.0, retry_for_s=SANDBOX_RETRY_S,
                                                     max_backoff_s=2.0))

    async def run(self, name: str | None, arguments: dict[str, Any], task: Task, error: str | None) -> str:
        """The observation text for one call (an error message for a malformed or unknown call, or when
        the sandbox fails: the model sees it and may try again)."""
        if error is not None:
            return f"error: malformed tool call ({error})"
        if name not in TOOLS or (name not in task.tools and not (name == "run_tests" and FEEDBACK in task.tools)):
            return f"error: unknown tool {name!r}; available: {sorted(set(task.tools) & set(TOOLS))}"
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return "error: the call needs a non-empty string argument 'code'"
        body: dict[str, Any] = {"code": code, "timeout_s": self.timeout_s}
        spec = task.verifier
        if name == "run_tests":
            if spec.kind != "unit_tests":
                return "error: this task has no tests to run"
            body["code"] = spec.prefix + code
            body["tests"] = ([{"name": "tests", "code": spec.tests}] if isinstance(spec.tests, str)
                             else [t.model_dump() for t in spec.tests])
            if spec.entry_point:
                body["entry_point"] = spec.entry_point
        try:
            headers: dict[str, str] = {}
            propagate.inject(headers)  # the W3C trace context: the sandbox's span joins the group's trace
            r = await self.http.request("POST", "/v1/execute", json=body, headers=headers)
            out = r.json()
        except (httpx.HTTPError, ValueError) as e:  # shared.client's errors are httpx errors too
            return f"error: the sandbox could not run it ({type(e).__name__})"
        if name == "run_tests":
            tests = out.get("tests") or []
            lines = [f"{t.get('name')}: {t.get('status')}" + (f" - {t.get('message')}" if t.get("message") else "")
                     for t in tests]
            text = "\n".join(lines) or f"no test ran (status {out.get('status')})\n{out.get('stderr', '')}"
            if tests and all(t.get("status") == "passed" for t in tests):
                text = f"{ALL_PASSED}\n{text}"
        else:
            text = (f"status: {out.get('status')}, exit code {out.get('exit_code')}\n"
                    f"stdout:\n{out.get('stdout', '')}\nstderr:\n{out.get('stderr', '')}")
        return _clip_middle(text)

    async def close(self) -> None:
        await self.http.aclose()


@dataclass
class Rollout:
    """One multi-turn trajectory being built: completion ids after the prompt, with per-token log-probs,
    loss mask and version spans, and a record per turn."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[VersionSpan] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    generated_tokens: int = 0
    tool_rounds: int = 0
    tool_seconds: float = 0.0

    def add_generated(self, sample, tokenizer) -> None:
        start = len(self.ids)
        self.ids += sample.completion_ids
        self.logprobs += sample.logprobs
        self.mask += [1] * len(sample.completion_ids)
        self.versions += [v.shifted(start) for v in sample.versions]
        self.finish_reason = sample.finish_reason
        self.generated_tokens += len(sample.completion_ids)
        self.turns.append({"role": "assistant", "start": start, "end": len(self.ids),
                           "text": tokenizer.decode(sample.completion_ids, skip_special_tokens=True)})

    def add_observation(self, ids: list[int], text: str, calls: list[dict], seconds: float,
                        role: str = "tool") -> None:
        """Tokens the policy did not produce (a tool's result, or an environment's ``user`` reply): mask 0."""
        start = len(self.ids)
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.tool_rounds += 1
        self.tool_seconds += seconds
        self.turns.append({"role": role, "start": start, "end": len(self.ids), "text": text, "tool_calls": calls,
                           "seconds": seconds})


async def run_tool_loop(engine: Engine | EngineGate, tokenizer, runner: ToolRunner, task: Task,
                        prompt_ids: list[int], n: int, sampling: SamplingParams, max_tokens: int) -> list[Rollout]:
    """``n`` trajectories of ``task`` through up to ``task.max_turns`` assistant turns.

    A turn that ends with its end-of-turn token and holds tool calls is answered by the tools (all its
    calls, concurrently) and continued; anything else ends the trajectory. ``max_tokens`` bounds the
    whole completion (generated and observation tokens). Each turn's generation runs in a worker thread
    through ``engine``'s :class:`EngineGate` (pass the service's gate so that concurrent loops and the
    plain path take turns on the engine; a bare engine gets a gate of its own), and the engine is free
    for others while the tools run.
    """
    gate = engine if isinstance(engine, EngineGate) else EngineGate(engine)
    eos_id = tokenizer.eos_token_id
    eos_text = tokenizer.decode([eos_id]) if eos_id is not None else None
    rollouts = [Rollout() for _ in range(n)]
    (first,) = await gate.generate([GenerationRequest(prompt_ids, n, sampling)])
    for r, s in zip(rollouts, first):
        r.add_generated(s, tokenizer)
    feedback = FEEDBACK in task.tools and task.verifier.kind == "unit_tests"
    for _turn in range(1, task.max_turns):
        live = []
        for r in rollouts:
            if r.finish_reason != "stop" or len(r.ids) >= max_tokens:
                continue
            calls = parse_tool_calls(r.turns[-1]["text"])
            if not calls and feedback:  # the environment tests the answer itself
                calls = [ToolCall("run_tests", {"code": extract_code(r.turns[-1]["text"])})]
            if calls:
                live.append((r, calls))
        if not live:
            break

        async def observe(r: Rollout, calls) -> bool:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(runner.run(c.name, c.arguments, task, c.error) for c in calls))
            text = "\n\n".join(results)
            ids = tool_turn_ids(tokenizer, text, eos_text)
            r.add_observation(ids, text, [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in calls],
                              time.perf_counter() - t0)
            return not (feedback and len(calls) == 1 and text.startswith(ALL_PASSED))  # solved: no revision

        go_on = await asyncio.gather(*(observe(r, calls) for r, calls in live))
        live = [r for (r, _), more in zip(live, go_on) if more and len(r.ids) < max_tokens]
        if not live:
            break
        reqs = [GenerationRequest(prompt_ids + r.ids, 1, sampling.model_copy(
            update={"max_new_tokens": min(sampling.max_new_tokens, max_tokens - len(r.ids))})) for r in live]
        outs = await gate.generate(reqs)
        for r, (s,) in zip(live, outs):
            r.add_generated(s, tokenizer)
    for r in rollouts:
        if len(r.ids) >= max_tokens and r.finish_reason == "stop" and r.turns[-1]["role"] == "tool":
            r.finish_reason = "length"
    return rollouts
