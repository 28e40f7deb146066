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


# The same number standing as a word: no letter, digit, "_" or "." right before it, and no word
# character (nor "."/"," then one) right after, so "AZYUK2A", "x2", "2nd", "5x" and "12cm" hold none.
_WORD_NUMBER = re.compile(r"(?<![\w.])(?:(?<![\w)\]}.])-)?\d(?:[\d,]*\d)?(?:\.\d+)?(?![.,]?\w)")


def extract_last_word_number(text: str) -> str | None:
    """Last number of ``text`` that stands as a word (see ``_WORD_NUMBER``), thousands commas removed, or None.

    ``"so x = -3."`` gives ``"-3"``; ``"AZYUK2A"`` and ``"the 2nd"`` give None.
    """
    matches = _WORD_NUMBER.findall(text)
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


# ---------------------------------------------------------------- plain-text math (as a person types it)

_MATH_REGION = re.compile(r"\$\$.*?\$\$|\$.*?\$|\\\(.*?\\\)|\\\[.*?\\\]", re.DOTALL)
_SYMBOLIC = r"(?<![A-Za-z\\])(?:pi|sqrt|infinity)(?![A-Za-z])|[π√∞]"
# A run of numbers, operators and brackets on one line, with symbolic words (kept if it holds one).
_PLAIN_TOKEN = rf"(?:\d+(?:\.\d+)?|{_SYMBOLIC}|\*\*|[-+*/^×·(),]|[ \t])"
_PLAIN_RUN = re.compile(rf"{_PLAIN_TOKEN}+")
_HAS_SYMBOLIC = re.compile(_SYMBOLIC)
_LEAD, _TRAIL = " \t,+*/^×·", " \t,+*/^×·-"  # trimmed from a span's ends (a leading "-" is a sign)
_SQRT_CALL = re.compile(r"(?:(?<![A-Za-z\\])sqrt|√)\s*\(")
_SQRT_ATOM = re.compile(r"√\s*(\d+(?:\.\d+)?|\\pi|[A-Za-z])")
_WORDS = [(re.compile(r"(?<![A-Za-z\\])pi(?![A-Za-z])|π"), r"\\pi "),
          (re.compile(r"(?<![A-Za-z\\])infinity(?![A-Za-z])|∞"), r"\\infty "),
          (re.compile(r"\*\*"), "^"), (re.compile(r"[×·]"), r" \\cdot ")]


def _closing_paren(s: str, i: int) -> int:
    """Index of the ``)`` closing the ``(`` at ``s[i]``, or -1."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return -1


def plain_math_to_latex(expr: str) -> str:
    """A plain-text expression as LaTeX: ``pi``/``π`` → ``\\pi``, ``sqrt(x)``/``√(x)``/``√2`` →
    ``\\sqrt{…}``, ``infinity``/``∞`` → ``\\infty``, ``**`` → ``^``, ``×``/``·`` → ``\\cdot``,
    ``^(k)`` → ``^{k}``.

    ``"3*sqrt(2)"`` gives ``"3*\\sqrt{2}"``, ``"2pi/3"`` gives ``"2\\pi /3"``. Text that is not plain
    math comes back with the same substitutions and is otherwise unchanged.
    """
    for pat, rep in _WORDS:
        expr = pat.sub(rep, expr)
    while (m := _SQRT_CALL.search(expr)) and (end := _closing_paren(expr, m.end() - 1)) >= 0:
        expr = f"{expr[:m.start()]}\\sqrt{{{expr[m.end():end]}}}{expr[end + 1:]}"
    expr = _SQRT_ATOM.sub(lambda m: f"\\sqrt{{{m.group(1)}}}", expr)
    while (i := expr.find("^(")) >= 0 and (end := _closing_paren(expr, i + 1)) >= 0:
        expr = f"{expr[:i]}^{{{expr[i + 2:end]}}}{expr[end + 1:]}"
    return expr


def _trim_span(span: str) -> tuple[int, str]:
    """(offset, core) of a plain-math run: operators and blanks off its ends, and unmatched outer
    parentheses ("(it is 2pi)" gives "2pi"); core is "" when its parentheses do not balance."""
    core = span.lstrip(_LEAD)
    off = len(span) - len(core)
    core = core.rstrip(_TRAIL)
    while core.startswith("(") and core.count("(") > core.count(")"):
        core, off = core[1:].lstrip(_LEAD), off + 1 + len(core[1:]) - len(core[1:].lstrip(_LEAD))
    while core.endswith(")") and core.count(")") > core.count("("):
        core = core[:-1].rstrip(_TRAIL)
    return off, (core if core.count("(") == core.count(")") else "")


def latexify_plain_math(text: str) -> str:
    """``text`` with each plain-text math span outside ``$…$``, ``$$…$$``, ``\\(…\\)``, ``\\[…\\]`` that
    holds a symbolic word (``pi``, ``sqrt``, ``infinity``, ``π``, ``√``, ``∞``) rewritten as inline LaTeX
    (``$…$``, see :func:`plain_math_to_latex`), so that math-verify reads ``2pi`` as 2π, not as the
    number 2 or the product 2·p·i. Text without such a span comes back unchanged (the same object).
    A span whose parentheses do not balance is left alone. Linear in ``len(text)`` (a few regex passes).
    """
    regions = [m.span() for m in _MATH_REGION.finditer(text)]
    out, last, k = [], 0, 0
    for m in _PLAIN_RUN.finditer(text):
        if not _HAS_SYMBOLIC.search(m.group(0)):
            continue
        a, b = m.span()
        while k < len(regions) and regions[k][1] <= a:
            k += 1
        if k < len(regions) and regions[k][0] < b:
            continue  # inside (or across) LaTeX math: math-verify reads that itself
        off, core = _trim_span(m.group(0))
        if not _HAS_SYMBOLIC.search(core):
            continue
        out += [text[last:a + off], f"${plain_math_to_latex(core).strip()}$"]
        last = a + off + len(core)
    if not out:
        return text
    out.append(text[last:])
    return "".join(out)


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
