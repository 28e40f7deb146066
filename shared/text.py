"""Reading model output that more than one service needs: code blocks (the verifier scores them, the
rollout's tool loop tests them), numbers with units and dates (the verifier compares them, task
validation checks that a gold answer is readable). Pure functions that never raise on model text."""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """Code of a completion: the last ```python fenced block, else the last bare ``` block, else the text."""
    blocks = _PY_FENCE.findall(text) or _FENCE.findall(text)
    return blocks[-1] if blocks else text


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
