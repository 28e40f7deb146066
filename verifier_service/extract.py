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
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


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


def extract_code(text: str) -> str:
    """Code of a completion: the last ```python fenced block, else the last bare ``` block, else the text."""
    blocks = _PY_FENCE.findall(text) or _FENCE.findall(text)
    return blocks[-1] if blocks else text


_THINK_CLOSE = "</think>"


def strip_reasoning(text: str) -> str:
    """The part of ``text`` that is not reasoning: after its last ``</think>``, and cut at a ``<think>``
    that is never closed (a response stopped mid-thought has no answer outside its reasoning)."""
    close = text.rfind(_THINK_CLOSE)
    body = text[close + len(_THINK_CLOSE):] if close >= 0 else text
    open_ = body.find("<think>")
    return body[:open_] if open_ >= 0 else body


# ---------------------------------------------------------------- numbers with units

_SCALE = {"k": 1e3, "thousand": 1e3, "m": 1e6, "mn": 1e6, "mio": 1e6, "million": 1e6,
          "b": 1e9, "bn": 1e9, "billion": 1e9, "t": 1e12, "tn": 1e12, "trillion": 1e12}
_NUM_WITH_UNITS = re.compile(
    r"(?P<neg>\()?\s*"
    r"(?:(?<![\w)\]}.^])(?P<sign>[-+−]))?\s*"  # a sign, not a binary operator ("5-3" is 5 and 3)
    r"(?:(?P<cur>[$€£¥₹]|\b(?:usd|eur|gbp|jpy|chf|cad|aud)\b)\s*(?P<sign2>[-+−])?\s*)?"
    r"(?<![\w.^,/])(?P<num>(?:\d{1,3}(?:[,'\u00a0\u202f]\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?|\.\d+)(?![\d^]|[.,]\d)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?)(?![\d^]|[.,]\d))?"
    r"(?:\s*(?P<scale>thousand|million|billion|trillion|mio|mn|bn|tn|k|m|b|t)(?![a-z]))?"
    r"\s*(?P<pct>%)?\s*(?P<close>\))?",
    re.IGNORECASE)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-−]?[\d.]+)\s*\}\s*\{\s*([-−]?[\d.]+)\s*\}")
_LATEX_WRAP = re.compile(r"\\(?:text|mathrm|mbox|textbf|mathbf)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right")
_LATEX_CMD = re.compile(r"\\[a-zA-Z]+")


def _delatex(text: str) -> str:
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    text = _LATEX_WRAP.sub(r"\1", text)
    return _LATEX_NOISE.sub(" ", text.replace("\\%", "%")).replace("{", " ").replace("}", " ")


def parse_number(text: Any, scale_words: bool = True, last: bool = False, single: bool = False,
                 accounting: bool = False) -> float | None:
    """The number a string states, with units and formatting stripped, or None.

    Handles currency signs and codes, thousands separators (``,``, ``'``, no-break spaces), a trailing
    ``%`` (kept as the number: ``12%`` is 12), fractions ``3/4`` and ``\\frac{3}{4}``, exponents
    ``1.5e3``, the Unicode minus, units written after the number (``5kg``), and, when ``scale_words``,
    scales (``1.2 million``, ``3bn``; a one-letter scale only after a currency: ``$450k``, but ``12 m``
    is 12). A minus is a sign only where it cannot be a binary operator (``5-3`` holds 5 and 3).
    ``accounting`` reads ``(1,234)`` as −1234. A number touching ``^``, a letter before it or another
    separator (``2^10``, ``v3.5``, ``1.234,5``) is not read. Takes the first number, or the last with
    ``last``; with ``single`` the text must state one value (``5 or 6`` and ``\\sqrt{2}`` give None).
    Numbers pass through; booleans are not numbers.
    """
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    text = _delatex(text) if "\\" in text else text
    if single and _LATEX_CMD.search(text):
        return None  # \sqrt{2}, \pi...: not a plain number
    if single or last:
        values = [v for m in _NUM_WITH_UNITS.finditer(text) if (v := _value(m, scale_words, accounting)) is not None]
        if not values:
            return None
        if single and any(v != values[0] for v in values):
            return None
        return values[-1] if last else values[0]
    m = _NUM_WITH_UNITS.search(text)
    return None if m is None else _value(m, scale_words, accounting)


def _value(m: re.Match, scale_words: bool, accounting: bool = False) -> float | None:
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
    if accounting and m.group("neg") and m.group("close"):
        v = -v
    return v


# ---------------------------------------------------------------- dates

_MONTH_NAMES = ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
                "november", "december"]
_MONTHS = {**{m: i for i, m in enumerate(_MONTH_NAMES, 1)}, **{m[:3]: i for i, m in enumerate(_MONTH_NAMES, 1)},
           "sept": 9}
_ISO = re.compile(r"(?<!\d)(\d{4})[-/.](\d{1,2})[-/.](\d{1,2})(?!\d)")
_DMY_NUM = re.compile(r"(?<!\d)(\d{1,2})[-/.](\d{1,2})[-/.](\d{4})(?!\d)")
_MDY_TXT = re.compile(r"\b([a-z]{3,9})\.?\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(\d{4})\b", re.IGNORECASE)
_DMY_TXT = re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+([a-z]{3,9})\.?,?\s+(\d{4})\b", re.IGNORECASE)


def _dates(s: str, day_first: bool) -> list[str]:
    out = []
    for m in _ISO.finditer(s):
        out.append((m.start(), int(m[1]), int(m[2]), int(m[3])))
    for m in _MDY_TXT.finditer(s):
        if m[1].lower() in _MONTHS:
            out.append((m.start(), int(m[3]), _MONTHS[m[1].lower()], int(m[2])))
    for m in _DMY_TXT.finditer(s):
        if m[2].lower() in _MONTHS:
            out.append((m.start(), int(m[3]), _MONTHS[m[2].lower()], int(m[1])))
    for m in _DMY_NUM.finditer(s):
        a, b, y = int(m[1]), int(m[2]), int(m[3])
        d, mo = (a, b) if (day_first or a > 12) and b <= 12 else (b, a)
        out.append((m.start(), y, mo, d))
    dates = []
    for _, y, mo, d in sorted(out):
        try:
            dates.append(_dt.date(y, mo, d).isoformat())
        except ValueError:
            continue
    return dates


def normalise_date(text: Any, day_first: bool = False, single: bool = True) -> str | None:
    """``YYYY-MM-DD`` for a date written as ISO, ``March 31, 2024``, ``31 Mar 2024`` or ``03/31/2024``
    (``day_first`` reads ``03/04/2024`` as 3 April; an unambiguous one like 31/03 is read either way),
    or None when there is no valid date, or (``single``) two different ones."""
    if not isinstance(text, str):
        return None
    dates = _dates(text.strip(), day_first)
    if not dates or (single and len(set(dates)) > 1):
        return None
    return dates[0]


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
    candidates = []
    tag = extract_answer_tag(body)
    if tag is not None:
        candidates.append(tag)
    fences = _JSON_FENCE.findall(body)
    if fences:
        candidates.append(fences[-1])
    candidates += _balanced_objects(body)
    if not candidates:
        return None, "no JSON object in the response"
    err = None
    for c in candidates:
        try:
            return orjson.loads(c.strip()), None
        except orjson.JSONDecodeError as e:
            err = f"invalid JSON: {e}"
    return None, err
