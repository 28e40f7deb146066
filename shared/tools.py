"""The tool-call format models use in Flywheel (the Hermes / Qwen2.5 convention)::

    <tool_call>{"name": "run_python", "arguments": {"code": "print(1)"}}</tool_call>

A response may hold several calls. Each must be one JSON object with a string ``name`` and an object
``arguments`` (``{}`` when the tool takes none). The rules layer of the verifier checks the protocol;
the rollout's tool loop executes the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One parsed call. ``error`` is None for a well-formed call, else why it is malformed."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>…</tool_call>`` in ``text`` in order; a malformed one (not a JSON object with a
    string ``name`` and object ``arguments``, or never closed) comes back with ``error`` set. The JSON
    is decoded from the opening tag, so ``</tool_call>`` inside a string argument does not end the call.
    Never raises; linear in the text."""
    calls: list[ToolCall] = []
    i = 0
    while (a := text.find(OPEN, i)) >= 0:
        j = a + len(OPEN)
        while j < len(text) and text[j].isspace():
            j += 1
        try:
            obj, end = _DECODER.raw_decode(text, j)
        except (json.JSONDecodeError, RecursionError) as e:
            close = text.find(CLOSE, j)
            raw = text[j:close if close >= 0 else j + 200]
            why = "<tool_call> is never closed" if close < 0 else f"not valid JSON: {e}"
            calls.append(ToolCall(None, raw=raw[:2000], error=why))
            if close < 0:
                break
            i = close + len(CLOSE)
            continue
        raw = text[j:end]
        k = end
        while k < len(text) and text[k].isspace():
            k += 1
        closed = text.startswith(CLOSE, k)
        i = k + len(CLOSE) if closed else end
        calls.append(_check(obj, raw[:2000], None if closed else "no </tool_call> right after the JSON"))
    return calls


def _check(obj: object, raw: str, error: str | None) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall(None, raw=raw, error=error or "not a JSON object")
    name, args = obj.get("name"), obj.get("arguments", {})
    extra = sorted(set(obj) - {"name", "arguments"})
    if not isinstance(name, str) or not name:
        return ToolCall(None, raw=raw, error=error or "no string 'name'")
    if not isinstance(args, dict):
        return ToolCall(name, raw=raw, error=error or "'arguments' is not a JSON object")
    if extra:
        return ToolCall(name, args, raw=raw, error=error or f"unknown key(s) {extra}")
    return ToolCall(name, args, raw=raw, error=error)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call in the format above."""
    return OPEN + orjson.dumps({"name": name, "arguments": arguments}).decode() + CLOSE


def parse_llama3_json_calls(text: str) -> list[ToolCall]:
    """Calls in the Llama 3.1 JSON convention: the message (after an optional ``<|python_tag|>``) is one JSON
    object ``{"name": ..., "parameters": {...}}`` (``arguments`` is accepted for ``parameters``), or several
    separated by ``;``. A message that does not start with ``{`` holds no call; one that does but is not such an
    object comes back with ``error`` set. Never raises."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    calls, i = [], 0
    while i < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, i)
        except (json.JSONDecodeError, RecursionError) as e:
            calls.append(ToolCall(None, raw=body[i:i + 2000], error=f"not valid JSON: {e}"))
            break
        if isinstance(obj, dict) and "parameters" in obj and "arguments" not in obj:
            obj = {"name": obj.get("name"), "arguments": obj["parameters"],
                   **{k: v for k, v in obj.items() if k not in ("name", "parameters")}}
        calls.append(_check(obj, body[i:end][:2000], None))
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return calls


PARSERS = {"hermes": parse_tool_calls, "llama3_json": parse_llama3_json_calls}
"""Tool-call parsers by name: ``hermes`` (``<tool_call>`` tags, Qwen2.5 and Hermes models) and ``llama3_json``
(a bare JSON object, Llama 3.1 and 3.2)."""

CALL_FORMATS = {
    "hermes": '<tool_call>{"name": <tool name>, "arguments": {<its arguments>}}</tool_call>',
    "llama3_json": 'a message that is only {"name": <tool name>, "parameters": {<its arguments>}}',
}
"""How a call is written in each parser's convention (told to a model whose template renders no tools)."""
