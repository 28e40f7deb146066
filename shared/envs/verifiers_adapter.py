"""Environments written for the ``verifiers`` library, loaded as Flywheel environments without edits.

A loading function that returns a ``verifiers`` environment of the classic API (``vf.SingleTurnEnv``,
``vf.ToolEnv``, ``vf.MultiTurnEnv``; release :data:`PINNED`, the extra ``flywheel[verifiers]``) gives an
:class:`~shared.envs.api.Environment` of its formatted rows; one reward, ``verifiers_rubric``, scoring as
``Rubric.score_rollout`` does (the weighted sum of the rubric's functions, called with the named objects verifiers
gives them); a ToolEnv's functions as tools with verifiers' schemas; a MultiTurnEnv's ``setup_state``,
``env_response`` and stop conditions as hooks on a verifiers ``State`` kept per rollout. Any other shape is refused
(:class:`UnsupportedVerifiersEnv`), never adapted to a different reward. ``verifiers`` is imported only once such
an object was returned. Guide: docs/guides/verifiers.md.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import logging
import math
import re
import signal
import sys
import types
import uuid
from typing import Any, Callable

from shared.envs.api import MAX_METRICS, Environment, RewardError, Rubric
from shared.envs.tools import INJECTED
from shared.tools import PARSERS

log = logging.getLogger(__name__)

PINNED = "0.3.1"
"""The ``verifiers`` release adapted (the last with the classic API; 0.4 keeps only ``verifiers.v1``)."""
QUESTION = "_vf_question"
"""Where a row's ``question`` travels in the task (Flywheel takes ``question`` as the prompt and drops it)."""
BUILTIN_STOPS = frozenset({"has_error", "prompt_too_long", "max_turns_reached", "max_total_completion_tokens_reached",
                           "has_final_env_response", "no_tools_called"})
VF_KEYS = frozenset({"input", "task", "prompt", "completion", "answer", "info", "example_id", "client", "model",
                     "sampling_args", "is_completed", "is_truncated", "stop_condition", "tool_defs", "trajectory",
                     "trajectory_id", "reward", "advantage", "metrics", "timing", "error", "usage", "usage_tracker",
                     "final_env_response", "prompt_too_long", "timed_out"})
"""Keys of a verifiers ``State`` that are its own, not an environment's: never copied to Flywheel's state."""


class UnsupportedVerifiersEnv(ValueError):
    """A verifiers object the adapter cannot run as it runs under verifiers; the message says what and what is
    supported (:func:`shared.envs.loading.load_environment` reports it as an ``EnvironmentLoadError``)."""


def keep_signal_handlers() -> None:
    """Make building a verifiers environment keep this process's signal handlers: ``vf.Environment`` installs
    SIGINT/SIGTERM ones (teardown, then ``exit``) over the services' own, and fails off the main thread (where the
    scheduler loads environments). Its module gets a ``signal.signal`` that changes nothing (teardown still runs
    at exit). Nothing happens when ``verifiers`` was not imported or has no classic API."""
    if "verifiers" not in sys.modules:
        return
    try:
        module = importlib.import_module("verifiers.legacy.envs.environment")
    except Exception:  # noqa: BLE001 - another release, or a broken install: the loader reports it
        return
    kept = types.ModuleType("signal")
    kept.__dict__.update(vars(signal), signal=lambda signum, handler: signal.getsignal(signum))
    module.signal = kept


def is_verifiers_env(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a class defined in the ``verifiers`` package."""
    return any(c.__module__.split(".")[0] == "verifiers" for c in type(obj).__mro__)


def from_verifiers(vf_env: Any) -> Environment:
    """The Flywheel environment of ``vf_env`` (see the module docstring). Raises UnsupportedVerifiersEnv: no classic
    API, a dataset or tool the environment's code cannot build, or a shape not supported (the message names it)."""
    def refuse(why: str) -> UnsupportedVerifiersEnv:
        return UnsupportedVerifiersEnv(f"{why} (docs/guides/verifiers.md)")

    try:
        vf = importlib.import_module("verifiers.legacy")
    except ImportError:
        raise refuse(f"this verifiers release ({getattr(sys.modules.get('verifiers'), '__version__', '?')}) has "
                     f"no classic API; Flywheel adapts verifiers=={PINNED}'s SingleTurnEnv, ToolEnv and "
                     "MultiTurnEnv (pip install -e '.[verifiers]')") from None
    kind = _kind(vf_env, vf, refuse)
    leaves = _leaves(vf_env.rubric, vf, refuse)
    _warn_weights(vf_env, leaves)
    hooks = _Hooks(vf_env) if kind == "multi" else None
    max_turns = 1 if kind == "single" else vf_env.max_turns if vf_env.max_turns > 0 else None  # -1: the default
    try:
        held = vf_env.build_eval_dataset()
        return Environment(
            dataset=_rows(vf_env.get_dataset(), refuse), eval_dataset=None if held is None else _rows(held, refuse),
            system_prompt=vf_env.system_prompt, rubric=Rubric([_scorer(vf_env, leaves)]),
            name=vf_env.env_id or None, max_turns=max_turns, setup=hooks and hooks.setup,
            tools=[_tool(vf_env, t, refuse) for t in vf_env.tools] if kind == "tools" else [],
            env_response=hooks and hooks.env_response, cleanup=hooks and hooks.cleanup)
    except UnsupportedVerifiersEnv:
        raise
    except Exception as e:  # noqa: BLE001 - its dataset builder, a tool schema: the environment's own code
        raise refuse(f"{type(e).__name__}: {e}") from e


def _kind(env: Any, vf: Any, refuse: Callable[[str], Exception]) -> str:
    """``single``, ``tools`` or ``multi``: how Flywheel runs ``env``'s rollouts; refused when it cannot."""
    def overridden(base: type, *names: str) -> list[str]:
        return [n for n in names if getattr(type(env), n, None) is not getattr(base, n)]

    if not isinstance(env, vf.MultiTurnEnv):
        raise refuse("only SingleTurnEnv, ToolEnv and MultiTurnEnv (and subclasses) are supported, not EnvGroup, "
                     "verifiers.v1 or custom rollout loops")
    if env.message_type != "chat":
        raise refuse(f"message_type {env.message_type!r} is not supported: Flywheel renders chat prompts")
    if bad := overridden(vf.MultiTurnEnv, "rollout", "get_prompt_messages", "add_model_response", "init_state"):
        raise refuse(f"it overrides {bad}, which Flywheel's rollout does not call")
    if isinstance(env, vf.SingleTurnEnv):
        if bad := overridden(vf.SingleTurnEnv, "setup_state", "render_completion"):
            raise refuse(f"a single-turn environment overriding {bad} is not supported")
        return "single"
    if isinstance(env, vf.ToolEnv):
        if bad := overridden(vf.ToolEnv, "env_response", "call_tool", "setup_state", "render_completion"):
            raise refuse(f"a ToolEnv overriding {bad} (a StatefulToolEnv, a sandbox) is not supported: Flywheel "
                         "calls the tools itself")
        if extra := sorted({c.__name__ for c in env._stop_conditions} - BUILTIN_STOPS):
            raise refuse(f"stop conditions {extra} of a ToolEnv are not supported (Flywheel's tool loop stops at a "
                         "turn without a tool call or at max_turns)")
        return "tools"
    if env.tool_defs or overridden(vf.MultiTurnEnv, "render_completion"):
        raise refuse("a MultiTurnEnv with tool_defs (not a ToolEnv) or overriding render_completion is not supported")
    return "multi"


def _leaves(rubric: Any, vf: Any, refuse: Callable[[str], Exception]) -> list[Any]:
    """The plain rubrics whose functions make ``rubric``'s score (a ``RubricGroup`` sums its rubrics)."""
    if isinstance(rubric, vf.RubricGroup) and type(rubric).score_rollout is vf.RubricGroup.score_rollout:
        return [leaf for r in rubric.rubrics for leaf in _leaves(r, vf, refuse)]
    name = type(rubric).__name__
    for method in ("score_rollout", "score_objects", "_call_individual_reward_func"):
        if getattr(type(rubric), method) is not getattr(vf.Rubric, method):
            raise refuse(f"rubric {name} overrides {method}, which the adapter does not call")
    if rubric.has_advantages:
        raise refuse(f"rubric {name} computes its own advantages; Flywheel computes GRPO's")
    for f in rubric.funcs:
        if rubric._is_group_func(f):
            raise refuse(f"group reward function {getattr(f, '__name__', f)!r} (it takes completions, states... "
                         "or returns a list) is not supported: Flywheel scores each completion on its own")
    return [rubric]


def _weights(leaves: list[Any]) -> dict[str, float]:
    """Each reward function's weight by name, over every leaf rubric (a name twice: its weights added)."""
    out: dict[str, float] = {}
    for leaf in leaves:
        for func, weight in zip(leaf.funcs, leaf.weights):
            name = getattr(func, "__name__", repr(func))
            out[name] = out.get(name, 0.0) + float(weight)
    return out


def _warn_weights(env: Any, leaves: list[Any]) -> None:
    """Log a warning when the rubric's weights add to more than 1: its score is their weighted sum, so a rollout
    that every function gives 1.0 would score above 1, which Flywheel refuses when it scores (a reward error, never
    a reward); better said once when the environment is loaded than at every scoring."""
    weights = _weights(leaves)
    total = sum(weights.values())
    if total > 1 + 1e-9:
        log.warning("verifiers environment %s: its rubric's weights %s add to %.4g, more than 1; its score is the "
                    "weighted sum (Σ weight · value) and Flywheel's rewards are in [0, 1], so a rollout that scores "
                    "above 1 is a reward error, never trained on: scale the weights to add to 1",
                    getattr(env, "env_id", None) or type(env).__name__, weights, total)


def _rows(dataset: Any, refuse: Callable[[str], Exception]) -> list[dict[str, Any]]:
    """The formatted rows of a verifiers dataset as Flywheel rows (``info`` given as JSON text decoded)."""
    rows = []
    for i, raw in enumerate(dataset):
        row = dict(raw)
        prompt = row.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                            for m in prompt)):
            raise refuse(f"row {i}'s prompt is not a list of text chat messages (multimodal content and text "
                         "prompts are not supported)")
        row["prompt"] = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if isinstance(row.get("info"), str):
            row["info"] = json.loads(row["info"]) if row["info"] else {}
        if "question" in row:
            row[QUESTION] = row.pop("question")
        rows.append(row)
    return rows


def _state(env: Any, prompt: list[dict], task: dict, answer: Any, info: Any) -> Any:
    """A verifiers ``State`` of one row, as ``Environment.init_state`` makes it (without a client)."""
    from verifiers.legacy.types import RolloutTiming, State, flatten_task_input
    from verifiers.legacy.utils.message_utils import normalize_messages

    row = {"question" if k == QUESTION else k: v for k, v in (task or {}).items() if k not in ("answer", "info")}
    row |= {"prompt": [dict(m) for m in prompt], "info": info or {}, **({} if answer is None else {"answer": answer})}
    row = flatten_task_input(row)
    state = State(input=row)
    state["task"] = row
    state["prompt"] = normalize_messages(row["prompt"], field_name="input.prompt")
    state.update(client=None, model=None, sampling_args=None, is_completed=False, is_truncated=False, completion=None,
                 tool_defs=list(env.tool_defs or []), trajectory=[], trajectory_id=uuid.uuid4().hex, reward=None,
                 metrics=None, error=None, final_env_response=None, timing=RolloutTiming())
    return state


def _step(state: Any, prompt: list, message: Any) -> dict[str, Any]:
    return {"prompt": prompt, "completion": [message], "response": None, "tokens": None, "reward": None,
            "advantage": None, "is_truncated": False, "trajectory_id": state["trajectory_id"], "extras": {}}


def _messages(env: Any, completion: str | None, turns: list[dict]) -> list[Any]:
    """A rollout as verifiers' completion messages: assistant turns (the tool calls Flywheel parsed apart, ids
    ``call_<turn>_<n>``, the text around them as content, as an OpenAI-compatible server answers), a turn's tool
    results as one tool message, ``env_response`` turns as user messages; one assistant message without turns."""
    from verifiers.legacy.types import AssistantMessage, ToolCall, ToolMessage, UserMessage

    parse = PARSERS["hermes"] if getattr(env, "tools", None) else None
    out: list[Any] = []
    call_ids: list[str] = []
    for i, turn in enumerate(turns or [{"role": "assistant", "text": completion or ""}]):
        text = turn.get("text") or ""
        if turn.get("role") == "assistant":
            calls = [c for c in (parse(text) if parse else []) if c.error is None]
            call_ids = [f"call_{i}_{n}" for n in range(len(calls))]
            content = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.S).strip() or None if calls else text
            out.append(AssistantMessage(content=content, tool_calls=[ToolCall(
                id=k, name=c.name, arguments=json.dumps(c.arguments)) for k, c in zip(call_ids, calls)] or None))
        elif turn.get("role") == "tool":
            out.append(ToolMessage(content=text, tool_call_id=call_ids[0] if call_ids else f"call_{i}"))
        else:
            out.append(UserMessage(content=text))
    return out


def _scorer(env: Any, leaves: list[Any]) -> Callable[..., Any]:
    from verifiers.legacy.utils.async_utils import maybe_call_with_named_args

    async def verifiers_rubric(**context: Any) -> dict[str, float]:
        """The verifiers rubric's reward of one rollout: Σ weight · function value, as ``score_rollout``; a
        function that raises or returns no finite number is a :class:`RewardError` (verifiers would count 0), and
        so is a weighted sum outside [0, 1] (the message says it is the sum, with the weights and values)."""
        state = _state(env, context["prompt"], context.get("task"), context.get("answer"), context.get("info"))
        done = state["completion"] = _messages(env, context.get("completion"), context.get("turns"))
        state["trajectory"] = [_step(state, state["prompt"] + done[:i], m) for i, m in enumerate(done)
                               if m.role == "assistant"]
        state.update({k: v for k, v in (context.get("state") or {}).items() if k not in VF_KEYS}, is_completed=True)
        total, metrics = 0.0, {}
        for leaf in leaves:
            objects = leaf.score_objects(state)
            for func, weight in zip(leaf.funcs, leaf.weights):
                name = getattr(func, "__name__", repr(func))
                try:
                    value = float(await maybe_call_with_named_args(func, **objects))
                except Exception as e:  # noqa: BLE001 - the user's reward function
                    raise RewardError(f"verifiers reward {name!r} raised {type(e).__name__}: {str(e)[:300]}") from e
                if not math.isfinite(value):
                    raise RewardError(f"verifiers reward {name!r} returned {value}")
                total += weight * value
                metrics[name] = metrics.get(name, 0.0) + value
        if not -1e-9 <= total <= 1 + 1e-9:
            raise RewardError(f"the verifiers rubric's weighted sum {total:.4g} (Σ weight · value; weights "
                              f"{_weights(leaves)}, values {metrics}) is outside [0, 1]; Flywheel rewards are in "
                              "[0, 1] with 1.0 a pass: scale the weights to add to 1")
        return {"score": total, **dict(list(metrics.items())[:MAX_METRICS])}

    verifiers_rubric.verifiers_weights = _weights(leaves)  # what `flywheel env check` shows of the rubric
    return verifiers_rubric


def _tool(env: Any, func: Callable, refuse: Callable[[str], Exception]) -> Callable:
    """``func`` as a Flywheel tool: verifiers' schema, its result as text, an exception as ``error_formatter``'s
    text (a ``stop_errors`` one too: Flywheel does not end a rollout on a tool error)."""
    name = getattr(func, "__name__", type(func).__name__)
    if clash := [p for p in inspect.signature(func).parameters if p in INJECTED]:
        raise refuse(f"tool {name!r} has parameter(s) {clash}, which Flywheel fills itself; rename them")
    spec = next(t for t in env.tool_defs if t.name == name)
    fmt = env.error_formatter

    @functools.wraps(func)  # its signature: Flywheel checks the model's arguments against it
    async def tool(**kwargs: Any) -> str:  # a sync function runs in a worker thread, as Flywheel runs its own
        try:
            return str(await (func(**kwargs) if inspect.iscoroutinefunction(func) else
                              asyncio.to_thread(func, **kwargs)))
        except Exception as e:  # noqa: BLE001 - shown to the model, as verifiers does
            return fmt(e)

    tool.__name__ = name
    tool.schema = {"type": "function", "function": {"name": name, "description": spec.description,
                                                    "parameters": spec.parameters}}
    return tool


class _Hooks:
    """A MultiTurnEnv's loop as Flywheel hooks, one verifiers ``State`` and message list per rollout (keyed by
    the rollout's state dict, dropped at cleanup); the environment's own keys are copied to Flywheel's state."""

    def __init__(self, env: Any) -> None:
        self.env, self.live = env, {}  # id(Flywheel state) -> (verifiers State, messages so far)

    async def setup(self, state: dict, task: dict, prompt: list[dict], answer: Any, info: dict) -> None:
        vs = await self.env.setup_state(fresh := _state(self.env, prompt, task, answer, info)) or fresh
        self.live[id(state)] = (vs, list(vs["prompt"]))
        state.update({k: v for k, v in dict.items(vs) if k not in VF_KEYS})

    async def env_response(self, completion: str, state: dict) -> str | None:
        """The environment's reply to the last turn; None once a stop condition holds or it gave a final one.
        Raises ValueError (a hook error) for a reply that is not text user messages."""
        from verifiers.legacy.types import AssistantMessage
        from verifiers.legacy.utils.message_utils import normalize_messages

        vs, messages = self.live[id(state)]
        vs["trajectory"].append(_step(vs, list(messages), message := AssistantMessage(content=completion)))
        messages.append(message)
        try:
            if await self.env.is_completed(vs):
                return None
            reply = normalize_messages(await self.env.env_response(list(messages), vs), field_name="env_response")
        finally:
            state.update({k: v for k, v in dict.items(vs) if k not in VF_KEYS})
        if vs.get("final_env_response") is not None:
            return None
        if bad := [m.role for m in reply if m.role != "user" or not isinstance(m.content, str)]:
            raise ValueError(f"env_response returned {bad} messages; Flywheel takes text user messages")
        messages.extend(reply)
        return "\n\n".join(m.content for m in reply)

    async def cleanup(self, state: dict) -> None:
        if (live := self.live.pop(id(state), None)) is not None:
            await self.env.cleanup(live[0])
