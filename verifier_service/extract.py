"""Answer extraction and value normalisation shared by the verifier's layers.

Everything here is pure, synchronous and never raises on model text: a missing answer is ``None``.
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any

import orjson

_DETAIL_TEXT_LIMIT = 2000  # characters of stdout/stderr/exception text kept in details


def clip(text: str | None) -> str:
    """``text`` cut to 2,000 characters (for reward details)."""
    text = text or ""
    return text if len(text) <= _DETAIL_TEXT_LIMIT else text[:_DETAIL_TEXT_LIMIT] + "...[truncated]"


# A minus sign counts only when it is not a binary operator ("5-3" gives 5 and 3, "= -3" gives -3).
_NUMBER = re.compile(r"(?:(?<![\w)\]}.])-)?\d(?:[\d,]*\d)?(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_last_number(text: str) -> str | None:
    """Last integer or decimal in ``text`` with thousands commas removed ("1,234." gives "1234"), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer_tag(text: str) -> str | None:
    """Stripped content of the last ``<answer>...</answer>`` in ``text``, or None."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        while i < len(text):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : i].strip()
            i += 1
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


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


def extract_code(text: str) -> str:
    """Code of a completion: the last ```python fenced block, else the last bare ``` block, else the text."""
    blocks = _PY_FENCE.findall(text) or _FENCE.findall(text)
    return blocks[-1] if blocks else text


_THINK_CLOSE = "</think>"


def strip_reasoning(text: str) -> str:
    """The part of ``text`` after its last ``</think>`` (the whole text when there is none)."""
    i = text.rfind(_THINK_CLOSE)
    return text[i + len(_THINK_CLOSE):] if i >= 0 else text


# ---------------------------------------------------------------- numbers with units

_SCALE = {"k": 1e3, "thousand": 1e3, "m": 1e6, "mm": 1e6, "mn": 1e6, "mio": 1e6, "million": 1e6,
          "b": 1e9, "bn": 1e9, "billion": 1e9, "t": 1e12, "tn": 1e12, "trillion": 1e12}
_NUM_WITH_UNITS = re.compile(
    r"(?P<neg>\()?\s*(?P<sign>[-+−])?\s*(?P<cur>[$€£¥₹]|usd|eur|gbp|jpy|chf|cad|aud)?\s*(?P<sign2>[-+−])?\s*"
    r"(?P<num>(?:\d{1,3}(?:[,'\u00a0\u202f]\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?"
    r"\s*(?P<scale>thousand|million|billion|trillion|mio|mn|bn|tn|mm|k|m|b|t)?\b\.?\s*(?P<pct>%)?\s*(?P<close>\))?",
    re.IGNORECASE)


def parse_number(text: Any, scale_words: bool = True, last: bool = False) -> float | None:
    """The number a string states, with units and formatting stripped, or None.

    Handles currency signs and codes, thousands separators (``,``, ``'``, no-break spaces), a trailing
    ``%`` (kept as the number: ``12%`` is 12), fractions ``3/4``, exponents ``1.5e3``, the Unicode
    minus, accounting negatives ``(1,234)`` and, when ``scale_words``, scales (``1.2 million``,
    ``3bn``; a one-letter scale only after a currency: ``$450k``, but ``12 m`` is 12). Takes the
    first number in the text, or the last with ``last``. Numbers pass through; booleans are not numbers.
    """
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    if last:
        m = None
        for m in _NUM_WITH_UNITS.finditer(text):
            pass
    else:
        m = _NUM_WITH_UNITS.search(text)
    return None if m is None else _value(m, scale_words)


def _value(m: re.Match, scale_words: bool) -> float | None:
    raw = re.sub(r"[,'\u00a0\u202f]", "", m.group("num"))
    try:
        v = float(raw)
        if m.group("den"):
            den = float(m.group("den"))
            if den == 0:
                return None
            v /= den
    except ValueError:
        return None
    scale = (m.group("scale") or "").lower()
    # a lone k/m/b/t scales only an amount of money ("$1.2M"); "12 m" is twelve metres
    if scale_words and scale and (len(scale) > 1 or m.group("cur")):
        v *= _SCALE[scale]
    if m.group("sign") in ("-", "−") or m.group("sign2") in ("-", "−"):
        v = -v
    if m.group("neg") and m.group("close"):
        v = -v
    return v


# ---------------------------------------------------------------- dates

_MONTHS = {m: i for i, m in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], start=1)}
_ISO = re.compile(r"(\d{4})[-/.](\d{1,2})[-/.](\d{1,2})")
_DMY_NUM = re.compile(r"(\d{1,2})[-/.](\d{1,2})[-/.](\d{4})")
_MDY_TXT = re.compile(r"([a-z]{3,9})\.?\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(\d{4})", re.IGNORECASE)
_DMY_TXT = re.compile(r"(\d{1,2})(?:st|nd|rd|th)?\s+([a-z]{3,9})\.?,?\s+(\d{4})", re.IGNORECASE)


def normalise_date(text: Any, day_first: bool = False) -> str | None:
    """``YYYY-MM-DD`` for a date written as ISO, ``March 31, 2024``, ``31 Mar 2024`` or ``03/31/2024``
    (``day_first`` reads ``31/03/2024``-style numbers; an unambiguous one like 31/03 is read either
    way), or None when it is not a valid date."""
    if not isinstance(text, str):
        return None
    s = text.strip()
    try:
        if m := _ISO.search(s):
            y, mo, d = int(m[1]), int(m[2]), int(m[3])
        elif m := _MDY_TXT.search(s):
            mo, d, y = _MONTHS.get(m[1][:3].lower(), 0), int(m[2]), int(m[3])
        elif m := _DMY_TXT.search(s):
            d, mo, y = int(m[1]), _MONTHS.get(m[2][:3].lower(), 0), int(m[3])
        elif m := _DMY_NUM.search(s):
            a, b, y = int(m[1]), int(m[2]), int(m[3])
            d, mo = (a, b) if (day_first or a > 12) and b <= 12 else (b, a)
        else:
            return None
        return _dt.date(y, mo, d).isoformat()
    except ValueError:
        return None


# ---------------------------------------------------------------- JSON in a response

_JSON_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
MAX_JSON_CHARS = 1_000_000


def _balanced_object(text: str) -> str | None:
    """The first balanced ``{…}`` span of ``text`` (strings and escapes respected), or None."""
    start = text.find("{")
    while start != -1:
        depth, in_str, esc = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i + 1]
        start = text.find("{", start + 1)
    return None


def extract_json(text: str) -> tuple[Any, str | None]:
    """The JSON value a response gives as its answer, and an error (None on success).

    Looks in order at: the last ``<answer>`` tag, the last fenced ```json block, the first balanced
    ``{…}`` after any reasoning block. Returns ``(None, reason)`` when none parses.
    """
    body = strip_reasoning(text)
    if len(body) > MAX_JSON_CHARS:
        return None, f"response longer than {MAX_JSON_CHARS} characters"
    candidates = []
    tag = extract_answer_tag(body)
    if tag is not None:
        candidates.append(tag)
    fences = _JSON_FENCE.findall(body)
    if fences:
        candidates.append(fences[-1])
    obj = _balanced_object(body)
    if obj is not None:
        candidates.append(obj)
    if not candidates:
        return None, "no JSON object in the response"
    err = None
    for c in candidates:
        try:
            return orjson.loads(c.strip()), None
        except orjson.JSONDecodeError as e:
            err = f"invalid JSON: {e}"
    return None, err
