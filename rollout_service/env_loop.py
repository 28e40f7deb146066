"""A user environment's multi-turn loop in the rollout: its Python tools and its ``env_response``.

For a request whose task is scored by an environment (``verifier.kind: environment``) that has tools, an
``env_response``, a ``setup``/``cleanup`` hook or a workspace (:attr:`shared.envs.Environment.runs_loop`), each
of the ``n`` rollouts gets its own ``state`` dict and its own sandbox session (:mod:`shared.envs.sandbox`, made
at its first use): ``setup`` fills the state, then after every assistant turn

- tool calls in the turn (parsed by the environment's ``tool_parser``, :data:`shared.tools.PARSERS`) are run in
  this process
  (:func:`shared.envs.tools.call_tool`, each bounded by the environment's ``hook_timeout_s``), and their results
  enter as the chat template's ``tool`` message;
- a turn without a call goes to ``env_response``, whose text enters as a ``user`` message (``None``: done);
- without tools called and without ``env_response``, the rollout ends;

up to ``max_turns`` assistant turns or the token budget, token-in/token-out as the sandbox tool loop
(:mod:`rollout_service.tool_loop`: observation tokens have loss mask 0). ``cleanup`` runs at the end whatever
happened. The state travels with the trajectory (``Trajectory.state``) to the rewards. A hook that raises or
times out makes its rollout an ``error`` sample (an infrastructure failure, never a 0 reward); a tool that
raises is an observation the model reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_service.engine import Engine, EngineGate, GenerationRequest, Sample
from rollout_service.tool_loop import Rollout, tool_turn_ids
from shared.client import AsyncApiClient
from shared.envs import Environment
from shared.envs.sandbox import Sandbox
from shared.envs.tools import HookError, call_hook, call_tool
from shared.schemas import SamplingParams, Task
from shared.tools import CALL_FORMATS, PARSERS

TOOLS_SYSTEM_PROMPT = ("You can call these tools (JSON schemas):\n<tools>\n{schemas}\n</tools>\nTo call one, "
                       "write {call}; the result comes back in the next message.")
"""What the model is told about the tools when its chat template renders none (``{schemas}``: one JSON schema a
line; ``{call}``: the parser's :data:`shared.tools.CALL_FORMATS`), appended to the system message (or made one)."""

MAX_STATE_BYTES = 64 * 1024
"""Largest state carried with a trajectory (compact JSON); a larger one is replaced by a note saying so."""


@dataclass
class EnvRollout:
    """One rollout of an environment: the tokens and turns, the state at the end, and the hook error if any."""

    rollout: Rollout
    state: dict[str, Any]
    error: str | None = None
    sandbox: Sandbox | None = None

    def state_record(self) -> dict[str, Any]:
        """The state as JSON the trajectory can carry (non-JSON values as text)."""
        try:
            data = orjson.dumps(self.state, default=str, option=orjson.OPT_NON_STR_KEYS)
        except TypeError as e:
            return {"_unserialisable": str(e)[:200]}
        if len(data) > MAX_STATE_BYTES:
            return {"_too_large_bytes": len(data)}
        return orjson.loads(data)


def encode_with_tools(tokenizer, messages: list[dict[str, str]], schemas: list[dict[str, Any]],
                      parser: str = "hermes") -> list[int]:
    """Prompt ids of ``messages`` with the tools described: by the chat template itself (``tools=``, the Hugging
    Face convention) when it renders them, else by :data:`TOOLS_SYSTEM_PROMPT` in the system message."""
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = plain
    if schemas:
        try:
            text = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses tools: describe them ourselves
            text = plain
        if text == plain:
            described = TOOLS_SYSTEM_PROMPT.format(schemas="\n".join(orjson.dumps(s).decode() for s in schemas),
                                                   call=CALL_FORMATS[parser])
            if messages and messages[0]["role"] == "system":
                messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + described},
                            *messages[1:]]
            else:
                messages = [{"role": "system", "content": described}, *messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _context(task: Task, ro: EnvRollout) -> dict[str, Any]:
    spec = task.verifier
    return {"state": ro.state, "task": spec.task, "sandbox": ro.sandbox,
            "prompt": [m.model_dump() for m in task.prompt], "answer": spec.answer, "info": spec.info}


async def _observe(env: Environment, task: Task, ro: EnvRollout, turn: int) -> tuple[str, str, list[dict]] | None:
    """The next observation of one rollout after its last assistant turn: ``(role, text, calls)``, or None when
    the rollout is done.

    Raises:
        HookError: ``env_response`` raised or timed out.
    """
    text = ro.rollout.turns[-1]["text"]
    calls = PARSERS[env.tool_parser](text) if env.tools else []
    if calls:
        injected = {"state": ro.state, "task": task.verifier.task, "sandbox": ro.sandbox}
        results = await asyncio.gather(*(call_tool(env.tools, c.name, c.arguments, c.error, injected,
                                                   env.hook_timeout_s) for c in calls))
        return "tool", "\n\n".join(results), [{"name": c.name, "arguments": c.arguments, "error": c.error}
                                              for c in calls]
    if env.env_response is None:
        return None
    reply = await call_hook(env.env_response, {**_context(task, ro), "completion": text, "turn": turn},
                            env.hook_timeout_s)
    return None if reply is None else ("user", str(reply), [])


async def run_env_loop(engine: Engine | EngineGate, tokenizer, env: Environment, task: Task, prompt_ids: list[int],
                       n: int, sampling: SamplingParams, max_tokens: int,
                       sandbox: AsyncApiClient | None = None) -> list[EnvRollout]:
    """``n`` rollouts of ``task`` through ``env``'s loop (see the module docstring); ``max_tokens`` bounds each
    whole completion (generated and observation tokens). ``sandbox``: the client of the sandbox service through
    which each rollout gets its own session (:class:`shared.envs.sandbox.Sandbox`, made at its first use and
    ended after ``cleanup``); ``None``: tools and hooks get ``sandbox=None``."""
    gate = engine if isinstance(engine, EngineGate) else EngineGate(engine)
    eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else None
    workspace = env.packed_workspace()
    runs = [EnvRollout(Rollout(), {}, sandbox=None if sandbox is None else Sandbox(sandbox, workspace))
            for _ in range(n)]
    try:
        await _each(env.setup, env, task, runs)
        await _turns(gate, tokenizer, env, task, prompt_ids, [ro for ro in runs if ro.error is None], sampling,
                     max_tokens, eos_text)
    finally:
        try:
            await _each(env.cleanup, env, task, runs)
        finally:
            await asyncio.gather(*(ro.sandbox.close() for ro in runs if ro.sandbox is not None))
    return runs


async def _each(hook, env: Environment, task: Task, runs: list[EnvRollout]) -> None:
    """``hook`` (``setup`` or ``cleanup``, or ``None``) once per rollout, one after another; a hook that fails
    marks its rollout with the error (an earlier error of the rollout is kept)."""
    if hook is None:
        return
    for ro in runs:
        turns = ro.rollout.turns
        last = next((t["text"] for t in reversed(turns) if t["role"] == "assistant"), "")
        try:
            await call_hook(hook, {**_context(task, ro), "completion": last}, env.hook_timeout_s)
        except HookError as e:
            ro.error = ro.error or str(e)


async def _turns(gate: EngineGate, tokenizer, env: Environment, task: Task, prompt_ids: list[int],
                 live: list[EnvRollout], sampling: SamplingParams, max_tokens: int, eos_text: str | None) -> None:
    if not live:
        return
    (first,) = await gate.generate([GenerationRequest(prompt_ids, len(live), sampling)])
    for ro, s in zip(live, first):
        ro.rollout.add_generated(within(s, max_tokens), tokenizer)
    everyone = list(live)
    for turn in range(1, env.max_turns):
        steps = await asyncio.gather(*(_step(env, task, ro, turn, tokenizer, eos_text, max_tokens) for ro in live))
        live = [ro for ro, more in zip(live, steps) if more]
        if not live:
            break
        # every turn asks for what its rollout's budget has left; the engine decodes requests of different limits
        # (and the turns of many rollouts and groups, through the gate) as one batch. ``within`` stays as a guard
        # for engines that generate past a request's limit.
        reqs = [GenerationRequest(prompt_ids + ro.rollout.ids, 1, sampling.model_copy(
            update={"max_new_tokens": min(sampling.max_new_tokens, max_tokens - len(ro.rollout.ids))})) for ro in live]
        for ro, (s,) in zip(live, await gate.generate(reqs)):
            ro.rollout.add_generated(within(s, max_tokens - len(ro.rollout.ids)), tokenizer)
    for ro in everyone:
        r = ro.rollout
        if len(r.ids) >= max_tokens and r.finish_reason == "stop" and r.turns[-1]["role"] != "assistant":
            r.finish_reason = "length"


def within(sample: Sample, budget: int) -> Sample:
    """``sample`` cut to its first ``budget`` tokens (``finish_reason`` then ``length``), or itself when it fits."""
    if len(sample.completion_ids) <= budget:
        return sample
    spans = [v.model_copy(update={"end": min(v.end, budget)}) for v in sample.versions if v.start < budget]
    return dataclasses.replace(sample, completion_ids=sample.completion_ids[:budget],
                               logprobs=sample.logprobs[:budget], finish_reason="length", versions=spans)


async def _step(env: Environment, task: Task, ro: EnvRollout, turn: int, tokenizer, eos_text: str | None,
                max_tokens: int) -> bool:
    """One rollout's observation after its last turn, appended; whether it generates another turn."""
    r = ro.rollout
    if r.finish_reason != "stop" or len(r.ids) >= max_tokens:
        return False
    t0 = time.perf_counter()
    try:
        seen = await _observe(env, task, ro, turn)
    except HookError as e:
        ro.error = str(e)
        return False
    if seen is None:
        return False
    role, text, calls = seen
    r.add_observation(tool_turn_ids(tokenizer, text, eos_text, role), text, calls, time.perf_counter() - t0, role)
    return len(r.ids) < max_tokens
