"""Tools an environment gives the model: plain Python functions, described and called the Hugging Face way.

The JSON schema the model sees comes from the function's type hints and Google-style docstring
(``transformers.utils.get_json_schema``, the convention of ``apply_chat_template(tools=...)``), or from a
``schema`` attribute set on the function. Parameters named in :data:`INJECTED` are filled by Flywheel, never by
the model, and are left out of the schema: ``state`` (the rollout's own state dict, shared with the
environment's ``setup``, ``env_response`` and rewards), ``task`` (the dataset row) and ``sandbox`` (the rollout's
sandbox session and workspace, :class:`shared.envs.sandbox.Sandbox`), so a tool reaches this rollout's data
without the model naming it.

:func:`call_tool` turns a malformed call, an unknown tool, arguments that do not fit, a tool that raises or runs
past its timeout each into an ``error: ...`` observation the model reads; only a failure of the sandbox itself
(:class:`shared.envs.sandbox.SandboxError`) is raised, as :class:`HookError`: that is not the model's doing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Callable, Sequence

import orjson

from shared.envs.workspace import SandboxError

INJECTED = ("state", "task", "sandbox")
"""Tool parameters Flywheel fills (never in the schema, never taken from the model's arguments)."""

OBSERVATION_CHARS = 4000
"""Longest tool result shown to the model (characters); longer ones are cut in the middle."""


def tool_name(func: Callable) -> str:
    return getattr(func, "__name__", type(func).__name__)


@functools.lru_cache(maxsize=256)
def tool_schema(func: Callable) -> dict[str, Any]:
    """The function's ``{"type": "function", "function": {name, description, parameters}}`` schema.

    Raises:
        TypeError: the function has a parameter without a type hint or a docstring without a description of
            one (transformers' own message, which names it), and no explicit ``schema`` attribute.
    """
    explicit = getattr(func, "schema", None)
    if isinstance(explicit, dict):
        return explicit
    from transformers.utils import get_json_schema

    sig = inspect.signature(func)
    shown = [p for p in sig.parameters.values() if p.name not in INJECTED]

    def proxy(*args, **kwargs):  # the signature the model sees
        raise NotImplementedError

    proxy.__name__, proxy.__doc__ = tool_name(func), func.__doc__
    proxy.__signature__ = sig.replace(parameters=shown)
    proxy.__annotations__ = {k: v for k, v in getattr(func, "__annotations__", {}).items() if k not in INJECTED}
    try:
        return get_json_schema(proxy)
    except Exception as e:  # noqa: BLE001 - transformers raises its own types; they name the parameter
        raise TypeError(f"tool {tool_name(func)!r}: {e}") from None


@functools.lru_cache(maxsize=1024)
def _parameters(func: Callable) -> dict[str, inspect.Parameter]:
    """``func``'s parameters (cached: a tool or hook is called once per turn of every rollout)."""
    return dict(inspect.signature(func).parameters)


async def _bounded(func: Callable, kwargs: dict[str, Any], timeout_s: float) -> Any:
    """``func(**kwargs)``, a sync one in a worker thread, bounded by ``timeout_s``.

    Raises:
        asyncio.TimeoutError: past it (a sync function keeps its thread until it returns); whatever it raises.
    """
    if inspect.iscoroutinefunction(func):
        return await asyncio.wait_for(func(**kwargs), timeout=timeout_s)
    return await asyncio.wait_for(asyncio.to_thread(func, **kwargs), timeout=timeout_s)


def _clip_middle(text: str, n: int = OBSERVATION_CHARS) -> str:
    return text if len(text) <= n else text[: n // 2] + "\n...[cut]...\n" + text[-n // 2:]


def _observation(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return orjson.dumps(result, default=str).decode()
    except TypeError:
        return str(result)


async def call_tool(tools: Sequence[Callable], name: str | None, arguments: dict[str, Any], error: str | None,
                    injected: dict[str, Any], timeout_s: float) -> str:
    """The observation of one call: the tool's result as text (JSON for non-text results), or ``error: ...``.

    Sync tools run in a worker thread and async ones on the loop, both bounded by ``timeout_s`` (a sync tool
    past it keeps its thread until it returns; the model is told it timed out).

    Raises:
        HookError: the tool's sandbox failed (:class:`shared.envs.sandbox.SandboxError`).
    """
    if error is not None:
        return f"error: malformed tool call ({error})"
    by_name = {tool_name(t): t for t in tools}
    if name not in by_name:
        return f"error: unknown tool {name!r}; available: {sorted(by_name)}"
    func = by_name[name]
    params = _parameters(func)
    given = {k: v for k, v in arguments.items() if k not in INJECTED}
    unknown = sorted(set(given) - set(params))
    missing = sorted(p.name for p in params.values() if p.default is p.empty and p.name not in given
                     and p.name not in INJECTED and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    if unknown or missing:
        return f"error: {name} " + "; ".join(filter(None, [unknown and f"takes no argument(s) {unknown}",
                                                           missing and f"needs argument(s) {missing}"]))
    kwargs = {**given, **{k: v for k, v in injected.items() if k in params}}
    try:
        result = await _bounded(func, kwargs, timeout_s)
    except asyncio.TimeoutError:
        return f"error: {name} did not finish within {timeout_s:g} s"
    except SandboxError as e:
        raise HookError(f"tool {name}: {e}") from e
    except Exception as e:  # noqa: BLE001 - the user's tool: the model sees what went wrong
        return f"error: {name} raised {type(e).__name__}: {str(e)[:500]}"
    return _clip_middle(_observation(result))


class HookError(Exception):
    """An environment's ``setup``, ``env_response`` or ``cleanup`` raised or ran past its timeout: the rollout's
    sample becomes an ``error`` sample (an infrastructure failure, never a 0 reward)."""


async def call_hook(func: Callable, context: dict[str, Any], timeout_s: float) -> Any:
    """``func`` called with the names of ``context`` it takes (all of them with ``**kwargs``), sync ones in a
    worker thread, bounded by ``timeout_s``.

    Raises:
        HookError: it raised or timed out (the message names the function).
    """
    params = _parameters(func)
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = context if takes_all else {k: v for k, v in context.items() if k in params}
    name = tool_name(func)
    try:
        return await _bounded(func, kwargs, timeout_s)
    except asyncio.TimeoutError:
        raise HookError(f"environment hook {name} did not finish within {timeout_s:g} s") from None
    except Exception as e:  # noqa: BLE001 - the user's code
        raise HookError(f"environment hook {name} raised {type(e).__name__}: {str(e)[:500]}") from e
