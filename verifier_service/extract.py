"""Answer extraction and value normalisation shared by the verifier's layers.

Everything here is pure, synchronous and never raises on model text: a missing answer is ``None``.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from shared.text import extract_code, normalise_date, parse_number  # noqa: F401 - re-exported

_DETAIL_TEXT_LIMIT = 2000  # characters of stdout/stderr/exception text kept in details


def clip(text: str | None) -> str:
    """``text`` cut to 2,000 characters (for reward details)."""
    text = text or ""
    return text if len(text) <= _DETAIL_TEXT_LIMIT else text[:_DETAIL_TEXT_LIMIT] + "...[truncated]"


# A minus sign counts only when it is not a binary operator ("5-3" gives 5 and 3, "= -3" gives -3).
_NUMBER = re.compile(r"(?:(?<![\w)\]}.])-)?\d(?:[\d,]*\d)?(?:\.\d+)?")


def extract_last_number(text: str) -> str | None:
    """Last integer or decimal in ``text`` with thousands commas removed ("1,234." gives "1234"), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def answer_tag_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the contents of every ``<answer>…</answer>`` in ``text`` in order (case-insensitive
    tags; an opening tag without a closing one is ignored). Linear time."""
    low, out, i = text.lower(), [], 0
    while (a := low.find("<answer>", i)) >= 0:
        b = low.find("</answer>", a + 8)
        if b < 0:
            break
        a = low.rfind("<answer>", a, b)  # the innermost opening tag before this closing one
        out.append((a + 8, b))
        i = b + 9
    return out


def answer_tags(text: str) -> list[str]:
    """Contents of every ``<answer>…</answer>`` in ``text`` (see :func:`answer_tag_spans`)."""
    return [text[a:b] for a, b in answer_tag_spans(text)]


def extract_answer_tag(text: str) -> str | None:
    """Stripped content of the last ``<answer>...</answer>`` in ``text``, or None."""
    tags = answer_tags(text)
    return tags[-1].strip() if tags else None


_BRACES = re.compile(r"\\boxed\{|\{|\}")


def boxed_contents(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{…}`` in ``text``, in order of their start (nested braces
    balanced; an unclosed one is skipped). One pass, linear time."""
    stack: list[int] = []
    found: list[tuple[int, str]] = []
    for m in _BRACES.finditer(text):
        if m.group(0) == "}":
            if stack:
                start = stack.pop()
                if start >= 0:
                    found.append((start, text[start:m.start()]))
        else:
            stack.append(m.end() if m.group(0) != "{" else -1)
    return [c for _, c in sorted(found)]


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    boxed = boxed_contents(text)
    return boxed[-1].strip() if boxed else None


def extract_answer(text: str, how: str) -> str | None:
    """Answer taken from a completion by ``how`` (``last_number``, ``answer_tag``, ``boxed``, ``full``).

    Returns None when nothing matches (``full`` gives None for blank text).

    Raises:
        ValueError: unknown ``how``.
    """
    if how == "last_number":
        return extract_last_number(text)
    if how == "answer_tag":
        return extract_answer_tag(text)
    if how == "boxed":
        return extract_boxed(text)
    if how == "full":
        return text.strip() or None
    raise ValueError(f"unknown extraction {how!r}")


_THINK_CLOSE = "</think>"


def strip_reasoning(text: str) -> str:
    """The part of ``text`` that is not reasoning: after its last ``</think>``, and cut at a ``<think>``
    that is never closed (a response stopped mid-thought has no answer outside its reasoning)."""
    close = text.rfind(_THINK_CLOSE)
    body = text[close + len(_THINK_CLOSE):] if close >= 0 else text
    open_ = body.find("<think>")
    return body[:open_] if open_ >= 0 else body


# ---------------------------------------------------------------- JSON in a response

_JSON_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
MAX_JSON_CHARS = 1_000_000


def _balanced_objects(text: str, limit: int = 32) -> list[str]:
    """Up to ``limit`` balanced ``{…}`` spans of ``text``, outermost ones, in order (string literals and
    escapes respected). One pass, linear time."""
    out: list[str] = []
    depth, start, in_str, esc = 0, -1, False, False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = depth > 0
        elif c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append(text[start:i + 1])
                if len(out) == limit:
                    break
    return out


def extract_json(text: str) -> tuple[Any, str | None]:
    """The JSON value a response gives as its answer, and an error (None on success).

    Looks in order at: the last ``<answer>`` tag, the last fenced ```json block, then each balanced
    ``{…}`` after any reasoning block; the first that parses wins. Returns ``(None, reason)`` when none
    parses.
    """
    body = strip_reasoning(text)
    if len(body) > MAX_JSON_CHARS:
        return None, f"response longer than {MAX_JSON_CHARS} characters"
    def candidates():  # lazily: the usual answer parses at the first one
        tag = extract_answer_tag(body)
        if tag is not None:
            yield tag
        fences = _JSON_FENCE.findall(body)
        if fences:
            yield fences[-1]
        yield from _balanced_objects(body)

    err = "no JSON object in the response"
    for c in candidates():
        try:
            return orjson.loads(c.strip()), None
        except orjson.JSONDecodeError as e:
            err = f"invalid JSON: {e}"
    return None, err
