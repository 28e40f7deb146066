"""The tool-call format models use in Flywheel (the Hermes / Qwen2.5 convention)::

    <tool_call>{"name": "run_python", "arguments": {"code": "print(1)"}}</tool_call>

A response may hold several calls. Each must be one JSON object with a string ``name`` and an object
``arguments`` (``{}`` when the tool takes none). The rules layer of the verifier checks the protocol;
the rollout's tool loop executes the calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call. ``error`` is None for a well-formed call, else why it is malformed."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>…</tool_call>`` in ``text`` in order, plus one malformed entry for an
    opening tag that is never closed. Never raises."""
    calls: list[ToolCall] = []
    end = 0
    for m in _CALL.finditer(text):
        end = m.end()
        raw = m.group(1).strip()
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            calls.append(ToolCall(None, raw=raw, error=f"not valid JSON: {e}"))
            continue
        if not isinstance(obj, dict):
            calls.append(ToolCall(None, raw=raw, error="not a JSON object"))
            continue
        name, args = obj.get("name"), obj.get("arguments", {})
        extra = sorted(set(obj) - {"name", "arguments"})
        if not isinstance(name, str) or not name:
            calls.append(ToolCall(None, raw=raw, error="no string 'name'"))
        elif not isinstance(args, dict):
            calls.append(ToolCall(name, raw=raw, error="'arguments' is not a JSON object"))
        elif extra:
            calls.append(ToolCall(name, args, raw=raw, error=f"unknown key(s) {extra}"))
        else:
            calls.append(ToolCall(name, args, raw=raw))
    if OPEN in text[end:]:
        calls.append(ToolCall(None, raw=text[text.index(OPEN, end):][:200], error="<tool_call> is never closed"))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call in the format above."""
    return OPEN + orjson.dumps({"name": name, "arguments": arguments}).decode() + CLOSE
