"""Answer extraction and value normalisation shared by the verifier's layers: every reading of a
completion's answer is here (the math kind's :func:`stated_answer` and :func:`math_candidates`
included); the scorers compare what these return.

Everything here is pure, synchronous and never raises on model text: a missing answer is ``None``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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

    ``"so x = -3."`` gives ``"-3"``; ``"AZYUK2A"`` and ``"the 2nd"`` give None, and so does a last number
    that is part of a larger expression (``"\\sqrt{2}"``, ``"x^2"``, ``"2!"``, ``"2%"``, ``"2:1"``,
    ``"2 million"``): a fragment is not the answer, and no earlier number stands in for it.
    """
    last = None
    for last in _WORD_NUMBER.finditer(text):
        pass
    if last is None or _NUMBER_IN_EXPR_BEFORE.search(text, 0, last.start()) \
            or _NUMBER_IN_EXPR_AFTER.match(text, last.end()):
        return None  # the last number is part of a larger expression: no number stands as the answer
    return last.group(0).replace(",", "")


# The last number is a fragment when a bracket, ^, _, a command or an operator is before it, or a bracket,
# power, %, !, ratio, command or scale word right after it ("\sqrt{2}", "x^2", "2!", "2 million").
_NUMBER_IN_EXPR_BEFORE = re.compile(r"(?:[{}^_\\(\[]|\\[A-Za-z]+\s*|[+*/×·][ \t]*|\d[ \t]*:[ \t]*|[\w)\]}][ \t]*-[ \t]*)$")
_NUMBER_IN_EXPR_AFTER = re.compile(r"[{}^_%!)\]\\]|:\s*\d|[ \t]*(?:\^|\\|[*/+×·]|-(?=[ \t]*[\w(]))|"
                                   r"[ \t]+(?i:hundred|thousand|million|billion|trillion|percent)")


_TAG_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_TAG_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)


def answer_tag_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the contents of every ``<answer>…</answer>`` in ``text`` in order (case-insensitive
    tags, blanks inside them allowed: ``< answer >``, ``</answer >``; an opening tag without a closing
    one is ignored). Linear time."""
    out, i = [], 0
    while (a := _TAG_OPEN.search(text, i)) is not None:
        b = _TAG_CLOSE.search(text, a.end())
        if b is None:
            break
        while (n := _TAG_OPEN.search(text, a.end(), b.start())) is not None:
            a = n  # the innermost opening tag before this closing one
        out.append((a.end(), b.start()))
        i = b.end()
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
    balanced; an unclosed one is skipped). One pass, linear time (:func:`box_spans`)."""
    return [text[a + len("\\boxed{"):b - 1] for a, b in box_spans(text)]


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
_SQRT_ATOM = re.compile(r"(?:√|(?<![A-Za-z\\])sqrt)\s*(\d+(?:\.\d+)?|\\pi|[A-Za-z](?![A-Za-z]))")
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
    """A plain-text expression as LaTeX: ``pi``/``π`` → ``\\pi``, ``sqrt(x)``/``√(x)``/``√2``/``sqrt2`` →
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


# ---------------------------------------------------------------- the answer a math completion states

_UNICODE_MINUS = re.compile("[\u2212\ufe63\uff0d]|(?:(?<=^)|(?<=[\\s(=$]))[\u2012\u2013](?=\\s?\\d)", re.M)
_FBOX = re.compile(r"\\fbox\s*\{")
_BARE_BOX = re.compile(r"\\boxed[ \t]+(\\[A-Za-z]+|[-\w.]+)")


def normalise_math_text(text: str) -> str:
    """``text`` with Unicode minus signs (U+2212, U+FE63, U+FF0D, and a figure or en dash used as a
    sign before a number) as ``-``, ``\\fbox{`` as ``\\boxed{`` and a brace-less ``\\boxed 3`` as
    ``\\boxed{3}``."""
    text = _UNICODE_MINUS.sub("-", text)
    text = _FBOX.sub(r"\\boxed{", text)
    return _BARE_BOX.sub(r"\\boxed{\1}", text)


def box_spans(text: str) -> list[tuple[int, int]]:
    """(start of ``\\boxed``, end after its closing brace) of every balanced ``\\boxed{…}``, in order."""
    stack: list[int] = []
    found: list[tuple[int, int]] = []
    for m in _BRACES.finditer(text):
        if m.group(0) == "}":
            if stack:
                start = stack.pop()
                if start >= 0:
                    found.append((start, m.end()))
        else:
            stack.append(m.start() if m.group(0) != "{" else -1)
    return sorted(found)


# A box that is an operand: a power, index, command, letter, digit or bracket right after it, an
# operator after blanks, or one of ^ \cdot \times * / right before it.
_OPERAND_AFTER = re.compile(r"[\^_\w({\[]|\\(?!text|quad|qquad|[,;!: )\]\\$]|end|right|\s|$)|[ \t]*(?:[\^_*/+]|\\cdot|\\times|-(?=[ \t]*[\w\\(]))")
_OPERAND_BEFORE = re.compile(r"(?:[\^*/]|\\cdot|\\times)[ \t{]*$")


def box_is_operand(text: str, start: int, end: int) -> bool:
    """Whether the box ``text[start:end]`` is part of a larger expression (``\\boxed{2}^3``,
    ``\\boxed{2}\\pi``, ``\\boxed{2} \\cdot 3``), so not an answer by itself."""
    return bool(_OPERAND_AFTER.match(text, end) or _OPERAND_BEFORE.search(text[max(0, start - 12):start]))


# "the answer is", "Answer:", "**Final answer:**", "it is", "the point is", "the solutions are", …
_CUE = re.compile(r"(?i)\b(?:(?:final\s+)?answers?|results?|solutions?|values?|point|pair|interval|it)\b"
                  r"[ \t*]*(?:is|are|was|would\s+be|should\s+be|:)(?![A-Za-z])[ \t*:]*|\bit's[ \t]+")
_DELIMITED = re.compile(r"\$|\\\(|\\\[|\\boxed|\\begin\{")
_CLAUSE = re.compile(r"(?i),?\s+(?:because|since|as|which|so|when|where|given|hence|thus|therefore)\b"
                     r"|,\s+(?!(?:and|or|though|although|but|possibly|maybe|perhaps)\b)[A-Za-z]{2,}")
_SENTENCE_END = re.compile(r"\.+(?=\s|$)|[;?]|\n")


def final_statement(text: str, start: int = 0) -> tuple[int, str] | None:
    """(position of the cue, the stated answer) of the last "the answer is …" / "Answer: …" / "it is …"
    cue of ``text`` at or after ``start``: what follows the cue up to the end of its sentence (a ``.``
    before a blank or the end, ``;``, ``?``, a newline, or a clause such as ", since …"). A weak cue ("it is", "the value is", not
    "answer") counts only when math follows it ("I hope it is correct" states nothing). None when
    there is no such cue."""
    last = None
    for m in _CUE.finditer(text, start):
        rest = text[m.end():].lstrip(" \t")
        if rest.startswith("\n"):
            rest = rest.lstrip()
        end = _SENTENCE_END.search(rest)
        stated = rest[:end.start()] if end else rest
        if clause := _CLAUSE.search(stated):
            stated = stated[:clause.start()]  # "5, since 2 + 3 = 5", "5 because …"
        stated = stated.strip(" \t*,")
        strong = re.match(r"(?i)(?:final\s+)?answers?\b", m.group(0))
        if stated and (strong or _MATH_START.match(stated)):
            last = (m.start(), stated)
    return last


# What a weak cue ("it is", "the value is") must be followed by to state an answer ("it is correct" does not).
_MATH_START = re.compile(r"[-\d$\\(\[{]|[A-Za-z](?![A-Za-z'])")


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` without a trailing ``.``, ``,``, ``;``, blanks or ``**``."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip().strip("*").rstrip(" .,;").strip() if lines else ""


_ALTERNATIVE = re.compile(r"(?i)\b(?:or|either|possibly|maybe|perhaps|alternatively)\b|\\vee\b|\\lor\b|\\text\{\s*or\s*\}|(?<=[\w}])\s*\|\s*(?=[\w\\])")
_AND = re.compile(r"(?i)\band\b|\\text\{\s*and\s*\}")
_SCALE = re.compile(r"(?i)\b(?:hundred|thousand|million|billion|trillion|percent|dozen)s?\b|%|\d(?:st|nd|rd|th)\b")
_MATH_WORDS = {"sqrt", "pi", "infinity", "inf", "ln", "log", "sin", "cos", "tan", "exp", "frac", "and", "or",
               "either", "cdot", "times", "le", "leq", "ge", "geq", "in", "cup", "cap", "infty", "dfrac", "tfrac",
               "left", "right", "text", "mathrm", "circ", "pm", "mp", "neq"}
_FUNCTION_WORD = re.compile(r"(?<![\\A-Za-z])(ln|log|sin|cos|tan|exp)(?![A-Za-z])")
_WORDS_RE = re.compile(r"\\?[A-Za-z]{2,}")
_LETTERS_DIGIT = re.compile(r"(?<![\\A-Za-z])([A-Za-z]+)\d")
_SPACED_THOUSANDS = re.compile(r"-?\d{1,3}(?: \d{3})+(?:\.\d+)?")


_HEDGE = re.compile(r"(?i)(?:^|[(,;])\s*(?:or|possibly|maybe|perhaps|alternatively)\b[\s\w$(]{0,12}?-?\d|\d[^.\n]{0,20}\b(?:is|are)\s+also\s+possible")


def hedges(text: str) -> bool:
    """Whether ``text`` (what follows a box) offers another number ("(or possibly 3)", "3 is also possible")."""
    return bool(_HEDGE.search(text))


def has_alternatives(text: str) -> bool:
    """Whether ``text`` offers alternatives ("2 or 3", ``44 \\vee 45``, ``44 | 45``, "possibly 3")."""
    return bool(_ALTERNATIVE.search(text))


def plain_statement(stated: str) -> tuple[str | None, bool]:
    """(the math of a plain-text stated answer, whether it is prose) for a statement without LaTeX
    delimiters: ``"2x+1"`` gives ``"2x+1"``; a number followed only by unit words (``"18 dollars"``)
    gives the number; words in the middle, scale words, ``%`` or an ordinal make it prose (None, True).
    """
    s = stated.strip().strip("*").rstrip(" .,;").strip()
    if _SPACED_THOUSANDS.fullmatch(s):
        s = s.replace(" ", "")  # "1 000 000"
    if any(w.lower() not in _MATH_WORDS for w in _LETTERS_DIGIT.findall(s)):
        return None, True  # a number glued after letters ("x2", "K2"): a code, not math
    words = [w for w in _WORDS_RE.findall(s) if w.lstrip("\\").lower() not in _MATH_WORDS]
    if not words:
        return s or None, False
    prose = [w for w in words if not w.startswith("\\")]
    if not prose:
        return s, False
    head = s[:s.find(prose[0])].rstrip()
    tail = s[s.find(prose[0]):]
    if head and s[len(head)].isspace() and re.fullmatch(r"[A-Za-z ]+", tail) and not _SCALE.search(tail) and re.search(r"\d", head) \
            and not re.search(r"[A-Za-z]$", head):
        return head, False  # a number with its unit ("18 dollars")
    return None, True


def statement_as_latex(expr: str) -> str:
    """A plain-text or bare-LaTeX answer as inline LaTeX (``$…$``), function words as commands."""
    latex = _FUNCTION_WORD.sub(r"\\\1 ", plain_math_to_latex(expr)).strip()
    return f"${latex}$"


# ---------------------------------------------------------------- the math kind's readings

_SET_PART = re.compile(r"(?i),|\bor\b|\band\b|\beither\b|\\text\{\s*(?:or|and)\s*\}")
_VAR_EQ = re.compile(r"^\s*[A-Za-z](?:_\w)?\s*=\s*")


def stated_answer(body: str, gold: str) -> tuple[str | None, str | None]:
    """(the text to read instead of :func:`math_candidates`, why the completion states no single
    answer) for a normalised completion (:func:`normalise_math_text`); (None, None) leaves the reading
    to :func:`math_candidates`.

    * The last box is not the answer when it is an operand (``\\boxed{2}^3``, ``\\boxed{2}\\pi``) or
      offers alternatives (``44 \\vee 45``), or when hedged after it ("(or possibly 3)"): rejected.
    * A stated answer ("the answer is …", "Answer: …", "it is …", see :func:`final_statement`) after
      the last box (or anywhere, with no box) wins over the box: with LaTeX delimiters, the text from
      the cue on is read; in plain text (bare LaTeX included), the statement up to the end of its
      sentence is read as ``$…$``. With no cue and no box, a last line that is a bare ASCII expression
      (``(1, 2)``, ``2\\sqrt{3}``, ``x = 1, y = 2``) is that statement (``π``, ``√``, ``°`` lines are
      left to :func:`latexify_plain_math`).
    * A plain statement is rejected when it is not one whole expression (words inside, unless it holds
      one number standing as a word, "Sphere 3 hours ago"; a scale word, ``%``, an ordinal, ``!`` or a
      ratio the gold lacks), or offers alternatives ("2 or 3", "either")
      or several parts ("2 and 3") where the gold has none. Where the gold is a set, "1 or 2",
      "1 and 2", "x = 1, 2" are read as that set.
    """
    gold_alt = has_alternatives(gold)
    gold_multi = gold_alt or bool(_AND.search(gold)) or "," in gold
    gold_set = "\\{" in gold
    boxes = box_spans(body)
    after = boxes[-1][1] if boxes else 0
    if boxes:
        a, b = boxes[-1]
        if box_is_operand(body, a, b):
            return None, "the last box is part of a larger expression, not the answer by itself"
        if has_alternatives(body[a + 7:b - 1]) and not gold_alt:
            return None, "the boxed answer offers alternatives"
    st = final_statement(body, after)
    if st is None:
        if boxes:
            tail = body[after:]
            if hedges(tail) and not gold_alt:
                return None, "the answer is hedged after its box"
            return None, None
        line = last_line(body)
        if not re.search(r"[\dA-Za-z]", line) or not line.isascii() or _DELIMITED.search(line) or re.search(r"\\[)\]]", line) \
                or plain_statement(line)[1]:
            return None, None  # prose, or LaTeX math-verify reads itself
        pos, stated = 0, line
    else:
        pos, stated = st
    alt = has_alternatives(stated) and not gold_alt
    several = bool(_AND.search(stated)) and not gold_multi
    if _DELIMITED.search(stated):
        if alt or several:
            return None, "the stated answer offers alternatives"
        return (body[pos:] if boxes else None), None
    if _SCALE.search(stated) and not _SCALE.search(gold):
        return None, f"the stated answer {stated!r} is a fragment (a scale word, percent or ordinal)"
    if re.search(r"!|:\s*\d", stated) and not re.search(r"!|:", gold):
        return None, f"the stated answer {stated!r} is a fragment (a factorial or ratio)"
    expr, prose = plain_statement(stated)
    if prose and len(re.findall(r"\d+(?:[.,]\d+)*", stated)) == 1:
        expr = extract_last_word_number(stated)  # prose around one number standing as a word
    if expr is None:
        return None, f"the stated answer {stated!r} is not a whole expression"
    if gold_set and _SET_PART.search(expr):
        parts = [_VAR_EQ.sub("", p).strip() for p in _SET_PART.split(expr)]
        parts = [p for p in parts if p]
        if parts and not any(_VAR_EQ.match(p) or "=" in p for p in parts):
            return "$\\{" + ", ".join(parts) + "\\}$", None
    if alt or several:
        return None, f"the stated answer {stated!r} offers alternatives"
    return statement_as_latex(expr), None


def math_candidates(body: str, options: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The ``(how, text)`` readings of a reasoning-stripped completion that :func:`math_verify_compare`
    tries, lazily (a reading is built only when the one before found nothing), under ``options``:

    1. ``full``: the whole text, which math-verify reads itself (all of ``\\boxed{1}, \\boxed{2}`` as one
       set, a "final answer is" sentence after intermediate boxes); plain-text math (``2pi``,
       ``3*sqrt(2)``) rewritten as LaTeX first when the spec has the ``latex`` target;
    2. ``boxed``: the last ``\\boxed{}`` alone (unless ``boxed_match_priority`` is -1);
    3. ``last_number``: the last number standing as a word (``expr`` target only; never the 2 of
       ``AZYUK2A``, and none when the last number is a fragment such as the 2 of ``\\sqrt{2}``).

    Only used when :func:`stated_answer` finds no stated answer.
    """
    yield "full", latexify_plain_math(body) if "latex" in options["extraction"] else body
    boxed = extract_boxed(body) if options["boxed_match_priority"] >= 0 else None
    if boxed:
        yield "boxed", f"\\boxed{{{boxed}}}"
    num = extract_last_word_number(body) if "expr" in options["extraction"] else None
    if num is not None:
        yield "last_number", num
