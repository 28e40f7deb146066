"""Reading one stated answer: its canonical parts and its numeric value.

The hedging detector (:mod:`verifier_service.hacks.hedging`) compares stated answers with each other and
with the task's gold (:mod:`verifier_service.hacks.gold`) in these forms, so that equivalent restatements
(``10^3`` and ``1 000``, ``(1, 2)`` and ``x = 1, y = 2``) read as one answer. Every scan is linear in the text
and no sympy is used.
"""

from __future__ import annotations

import re
from typing import Any

from verifier_service.extract import boxed_contents, parse_number

_ASSIGN = re.compile(r"^[a-zA-Z]\w{0,10}\s*=\s*")


_ALNUM_TOKEN = re.compile(r"\d(?:[a-df-zA-DF-Z]|[eE][a-zA-Z])[a-zA-Z]*\d")  # 0x15a5a, 2x3: not a number and a unit
_NAMED = "\x1e"  # joins a part's name and value: "k\x1e45.0"


def _canon(a: str, keep_name: bool = False) -> str:
    """Canonical text of one stated answer: boxed content, no assignment prefix (kept as ``name\x1evalue``
    with ``keep_name``), one number as a float (``12 apples``, ``\\frac{1}{2}`` and ``0.5`` read as
    numbers; ``0x1f`` does not), else the text without spaces."""
    boxed = boxed_contents(a)
    a = (boxed[0] if boxed else a).strip().strip("$").strip().rstrip(".")
    name = ""
    if m := _ASSIGN.match(a):
        name, a = re.sub(r"[\s=]+", "", m.group(0)).casefold(), a[m.end():]
    v = None if _ALNUM_TOKEN.search(a) else parse_number(a, single=True)
    value = repr(v) if v is not None else re.sub(r"\s+", "", a).casefold()
    return f"{name}{_NAMED}{value}" if keep_name and name and value else value


_OR_WORD = re.compile(r"\bor\b", re.IGNORECASE)
_OR_SPLIT = re.compile(r"\s+or\s+|\s*\\(?:text|mathrm|textrm)\{\s*or\s*\}\s*", re.IGNORECASE)
_PART_SEP = re.compile(r",|;|\s+and\s+|\s*\\(?:text|mathrm|textrm)\{\s*and\s*\}\s*|\\q?quad\b", re.IGNORECASE)
_LATEX_SPACING = re.compile(r"\\left\b|\\right\b|\\[,;:! ]|\$")
_OPEN, _CLOSE = "([{", ")]}"
_THOUSANDS = re.compile(r"^[-−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _top_level_split(text: str, sep: re.Pattern) -> list[str]:
    """``text`` cut at the matches of ``sep`` that lie outside every bracket (linear)."""
    depth, cuts = 0, []
    marks = {m.start(): m.end() for m in sep.finditer(text)}
    i = 0
    while i < len(text):
        c = text[i]
        if depth == 0 and i in marks and marks[i] > i:
            cuts.append((i, marks[i]))
            i = marks[i]
            continue
        depth += (c in _OPEN) - (c in _CLOSE and depth > 0)
        i += 1
    out, last = [], 0
    for a, b in cuts:
        out.append(text[last:a])
        last = b
    out.append(text[last:])
    return [p for p in (s.strip() for s in out) if p]


def _unwrap(text: str) -> tuple[str, bool]:
    """``text`` without one pair of brackets around all of it, and whether they were set braces."""
    t = text.strip()
    if len(t) < 2 or t[0] not in _OPEN or _OPEN.index(t[0]) != _CLOSE.find(t[-1]):
        return t, False
    depth = 0
    for i, c in enumerate(t):
        depth += (c in _OPEN) - (c in _CLOSE)
        if depth == 0 and i < len(t) - 1:
            return t, False  # "(1, 2) \cup (3, 4)": the first bracket closes early
    return t[1:-1].strip(), t[0] == "{"


def _answer_parts(text: str, item_groups: bool = False) -> tuple[str, tuple[str, ...]]:
    """The canonical key and canonical parts of one stated answer: boxed content, outer brackets and
    LaTeX spacing dropped, split at top-level ``,`` ``;`` "and" ``\\quad``; a set's parts sorted. With
    ``item_groups`` (the gold is a list of bracketed items) a bracketed answer is one part."""
    boxed = boxed_contents(text)
    t = _LATEX_SPACING.sub(" ", boxed[0] if boxed else text).strip().rstrip(".").strip()
    t = t.replace("\\{", "{").replace("\\}", "}")  # LaTeX set braces
    inner, is_set = _unwrap(t)
    if item_groups and inner != t:
        return (c := _canon(t)), ((c,) if c else ())
    pieces = [inner] if _THOUSANDS.match(inner) else _top_level_split(inner, _PART_SEP)
    parts = tuple(c for p in pieces if (c := _canon(p, keep_name=len(pieces) > 1)))  # k = 45, n = 2: names kept
    if not parts:
        c = _canon(t)  # "{}": an empty set is still an answer
        if not c:
            return "", ()
        parts = (c,)
    key = tuple(sorted(parts)) if is_set else parts
    return "\x1f".join(key), parts


def _whole(text: str) -> str:
    """Canonical text of a structured answer: its JSON with sorted keys, else the text without spaces."""
    import orjson

    t = text.strip()
    try:
        return orjson.dumps(orjson.loads(t), option=orjson.OPT_SORT_KEYS).decode()
    except (orjson.JSONDecodeError, TypeError):
        return re.sub(r"\s+", "", t).casefold()


def _restates(p: tuple[str, ...], q: tuple[str, ...]) -> bool:
    """Whether answer ``p`` only restates parts of the longer answer ``q``: each part of ``p`` matches a
    part of its own in ``q`` (a value without a name matches a named part of that value: ``45`` in
    ``k = 45, n = 2``)."""
    if len(p) >= len(q):
        return False
    pool = list(q)
    for x in p:
        i = next((i for i, y in enumerate(pool) if y == x or (_NAMED not in x and y.endswith(_NAMED + x))), None)
        if i is None:
            return False
        pool.pop(i)
    return True


_NUMBER_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                            "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
_UNIT_TEXT = re.compile(r"\\(?:text|mathrm|textrm|mbox)\{\s*[A-Za-z][A-Za-z .]*\}|\^\s*\{?\\circ\}?|°|\\circ\b"
                        r"|\s+(?:degrees?|deg|units?|cm|m|km|kg|g|s|dollars?|apples?)\b\.?$", re.IGNORECASE)
_TAGS = re.compile(r"<\s*/?\s*answer\s*>", re.IGNORECASE)
_ARITH = re.compile(r"[\d\s.+\-−*/^(){}\\a-zπ√×·,!]+")
_MATH_WORDS = re.compile(r"\\?(?:[dt]?frac|sqrt|pi|cdot|times|left|right)|\\")
_LETTERS = re.compile(r"[a-z]")


_LEAD_PHRASE = re.compile(r"^(?:so|thus|hence|therefore)?,?\s*(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*", re.IGNORECASE)


def _clean(text: str) -> str:
    """One stated answer without its markup: answer tags, ``**``, a leading "the final answer is",
    outer quotes, ``$``, ``\\(…\\)``."""
    t = _LEAD_PHRASE.sub("", _TAGS.sub(" ", text).replace("**", " ").strip())
    for a, b in (("\\(", "\\)"), ("\\[", "\\]")):
        if t.startswith(a) and t.endswith(b):
            t = t[2:-2]
    return t.strip().strip("$").strip().strip("\"'“”‘’`").strip().rstrip(".").strip()


def _latex_to_py(t: str) -> str:
    """A small LaTeX or plain expression as Python arithmetic (``\\frac{a}{b}``, ``\\sqrt{x}``, ``π``, ``^``)."""
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("{,}", ""),
                     ("\\cdot", "*"), ("\\times", "*"), ("×", "*"), ("·", "*"), ("\\pi", " pi "), ("π", " pi "),
                     ("√", "sqrt"), ("\\sqrt", "sqrt"), ("\\frac", "frac"), ("−", "-"), ("^", "**"), ("\\,", ""),
                     ("\\!", ""), ("\\ ", "")):
        t = t.replace(old, new)
    # frac{a}{b} -> ((a)/(b)); sqrt{x} -> sqrt(x); remaining braces are groups
    t = re.sub(r"frac\s*(\d)\s*(\d)", r"((\1)/(\2))", t)
    for _ in range(8):  # frac{a}{b} -> ((a)/(b)), innermost first
        t2 = re.sub(r"frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", t)
        t2 = re.sub(r"sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", t2)
        if t2 == t:
            break
        t = t2
    t = t.replace("{", "(").replace("}", ")")
    t = re.sub(r"(?<=[\d)])\s*(?=[a-z(])", "*", t.strip())  # 2pi, 2sqrt(3), 2(3)
    return re.sub(r"\bpi\s*(?=[\d(a-z])", "pi*", t)


def _eval(node: Any) -> float:
    import ast
    import math

    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt" and len(node.args) == 1:
        return math.sqrt(_eval(node.args[0]))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        x, y = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(y) > 64 or abs(x) > 1e6:
                raise ValueError("power too large")
            return x ** y
        return {ast.Add: x + y, ast.Sub: x - y, ast.Mult: x * y}.get(type(node.op)) if not isinstance(node.op, ast.Div) else x / y
    raise ValueError("not arithmetic")


def _values(text: str) -> tuple[float, ...]:
    """The numeric value(s) one stated answer reads as, cheaply (no sympy): a number with thousands
    separators (``1,000``, ``1{,}000``, ``1 000``), units or a degree sign, a number word (``five``),
    ``10^3``, ``2π``, ``\\frac{\\sqrt{3}}{2}`` = ``sqrt(3)/2``; a percentage reads as ``p`` and ``p/100``.
    Empty when it is not plain arithmetic."""
    import ast

    t = _clean(text)
    if m := _ASSIGN.match(t):
        t = t[m.end():]
    if len(t) > 80:
        return ()
    if (w := t.casefold()) in _NUMBER_WORDS:
        return (float(_NUMBER_WORDS[w]),)
    t = _UNIT_TEXT.sub("", t).strip().strip("$").strip()
    pct = t.endswith("%")
    t = t.rstrip("%").rstrip("\\").strip()
    t = re.sub(r"(?<=\d)(?:,|\{,\}|\s)(?=\d{3}(?!\d))", "", t) if re.fullmatch(r"[-−]?\d{1,3}(?:(?:,|\{,\}|\s)\d{3})+(?:\.\d+)?", t) else t
    if not t or not _ARITH.fullmatch(t) or _LETTERS.search(_MATH_WORDS.sub("", t)):
        return ()
    try:
        v = _eval(ast.parse(_latex_to_py(t), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError, MemoryError):
        return ()
    if v != v or v in (float("inf"), float("-inf")):
        return ()
    return (v, v / 100) if pct else (v,)
