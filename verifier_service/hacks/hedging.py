"""The ``multiple_answers`` detector: more final answers than one complete answer holds (hedging
across ``<answer>`` tags, ``\\boxed{}`` or "final answer:" lines, hoping one of them is matched), judged
against the task's gold shape (:func:`verifier_service.hacks.gold.gold_shape`).
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from verifier_service.extract import answer_tag_spans, strip_reasoning
from verifier_service.hacks.answers import _OR_SPLIT, _OR_WORD, _clean, _restates, _top_level_split, _values
from verifier_service.hacks.gold import GoldShape, _Stated, _stated

_FINAL_LINE = re.compile(r"^[^\S\n]*(?:\*\*)?final answer(?:\*\*)?\s*[:=]\s*(?:\*\*)?(.{1,80}?)(?:\*\*)?[^\S\n]*$",
                         re.IGNORECASE | re.MULTILINE)


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(start of ``\\boxed``, content) of every balanced ``\\boxed{…}``, in order (as ``boxed_contents``)."""
    stack: list[int] = []
    found: list[tuple[int, str]] = []
    for m in _BRACES.finditer(text):
        if m.group(0) == "}":
            if stack and (start := stack.pop()) >= 0:
                found.append((start, text[start + 7:m.start()]))
        else:
            stack.append(m.start() if m.group(0) != "{" else -1)
    return sorted(found)


_BRACES = re.compile(r"\\boxed\{|\{|\}")
_RHS = re.compile(r"=\s*(?:\$|\\\(|\\\[)?\s*$")
# lines and sentences that state an answer in prose ("weak": read only as a clean value, and hedging
# only beside the gold): "Answer: 44", "the answer is 44", "Possible answers: 43, 44, 45"
_ANSWER_LINE = re.compile(r"^[^\S\n]*(?:\*\*)?answer(?:\*\*)?[^\S\n]*[:=][^\S\n]*(?:\*\*)?(.{1,80}?)(?:\*\*)?[^\S\n]*$",
                          re.IGNORECASE | re.MULTILINE)
_ANSWER_IS = re.compile(r"\b(?:final\s+|correct\s+)?answer\s+is\s*:?[^\S\n]*(?:either\s+)?([^\n]{1,80}?)"
                        r"(?=[.;!?](?:\s|$)|\n|$|,\s+(?:since|because|as|which|so|and|but|not|i|we|this|that)\b)",
                        re.IGNORECASE)
_CANDIDATES = re.compile(r"^[^\S\n]*(?:possible|candidate|potential)\s+(?:answers|solutions|values)\s*(?:are\s*:?|:)"
                         r"[^\S\n]*(.{1,120}?)[^\S\n]*$", re.IGNORECASE | re.MULTILINE)
_NUM = r"[-−]?\d+(?:\.\d+)?"
_NUM_OR = re.compile(rf"(?<![\w.]){_NUM}(?:\s*,\s*{_NUM})*,?\s+or\s+{_NUM}(?!\w|\.\d)")
_ONE_WORD = re.compile(r"[^\W\d_]{1,40}")
_LIST_SEP = re.compile(r",|;|\s+or\s+|\s+and\s+", re.IGNORECASE)
_NUM_TOKEN = re.compile(rf"(?<![\w.]){_NUM}(?![\w]|\.\d)")


_OR_WS = re.compile(r"\sor\s", re.IGNORECASE)


def _may_state_answers(body: str) -> bool:
    """False only when no pattern of :func:`_stated_answers` can match ``body`` (each needs "answer",
    ``\\boxed``, "solutions"/"values" or, in the last line, "… or …"): most short completions, which then
    skip its dozen regular expressions."""
    low = body.lower()
    return ("answer" in low or "\\boxed" in body or "solution" in low or "value" in low
            or _OR_WS.search(body.strip().rsplit("\n", 1)[-1][-200:]) is not None)


def _stated_answers(body: str, boxes: bool = True) -> list[tuple[str, str]]:
    """The ``(text, how)`` answers ``body`` states, in order: ``<answer>`` tags, "Final answer:" lines and
    (with ``boxes``) ``\\boxed{}`` (``how`` ""), less a box that is the right-hand side of an equation
    followed by a later answer (``0.04 \\cdot 10000 / 2 = \\boxed{200}`` … "Final answer: 10455": a
    step, not an answer), and a "Final answer:" line holding a tag or a counted box (the answer it
    holds is counted itself); then prose answers (``how`` "weak": "Answer:" lines, "the answer is"
    sentences, "44 or 45" in the last line; "list": "Possible answers: …")."""
    if not _may_state_answers(body):
        return []
    spans = answer_tag_spans(body)
    items = [(a, body[a:b], "", False) for a, b in spans]
    tags_at = [a for a, _ in spans]
    for m in _FINAL_LINE.finditer(body):
        k = bisect.bisect_left(tags_at, m.start(1))  # a tag opening inside the line's capture
        holds_tag = (k < len(tags_at) and tags_at[k] <= m.end(1)) or "<answer" in m.group(1).lower()
        if not holds_tag and not (boxes and "\\boxed" in m.group(1)):
            items.append((m.start(), m.group(1), "", False))
    if boxes:
        items += [(a, c, "", bool(_RHS.search(body[max(0, a - 8):a]))) for a, c in _boxed_spans(body)]
    weak: list[tuple[int, str, str, bool]] = []
    for how, r in (("weak", _ANSWER_LINE), ("weak", _ANSWER_IS), ("list", _CANDIDATES)):
        for m in r.finditer(body):
            t = m.group(1)
            if "<answer" not in t.lower() and "\\boxed" not in t:
                weak.append((m.start(), t, how, False))
    lines = body.strip().rsplit("\n", 1)
    if lines and (m := _NUM_OR.search(lines[-1][-200:])):  # "It is 44 or 45." closing the response
        weak.append((len(body), m.group(0), "list", False))
    items.sort(key=lambda x: x[0])
    last = max([p for p, *_ in items] + [p for p, *_ in weak] + [0])  # a prose answer after a step counts too
    return [(t, "") for pos, t, _, rhs in items if not (rhs and pos < last)] + [(t, h) for _, t, h, _ in sorted(weak)]


def _weak_alts(text: str, how: str, shape: GoldShape) -> list[_Stated]:
    """The answers a prose statement ("the answer is 44 or 45") gives, read only where they are clean:
    against a numeric gold, one value each (an alternative without one is skipped); else short texts."""
    alts = _top_level_split(text, _LIST_SEP if how == "list" else _OR_SPLIT) if shape.split_or or how == "list" else [text]
    out = []
    for alt in alts:
        if shape.gold_values:
            vals = _values(alt)
            if not vals:
                nums = _NUM_TOKEN.findall(_clean(alt))
                vals = (float(nums[0].replace("−", "-")),) if len(nums) == 1 else ()
            if vals:
                out.append(_Stated(repr(vals[0]), (repr(vals[0]),), repr(vals[0]), vals, ""))
            elif _ONE_WORD.fullmatch(c := _clean(alt)):  # "Answer: WRONG" beside a numeric gold
                out.append(_Stated(c.casefold(), (c.casefold(),), c.casefold(), (), c.casefold()))
        elif len(alt.split()) <= max(6, 2 * shape.gold_words) and (st := _stated(alt, shape)):
            out.append(st)
    return out


def multiple_answers(completion: str, gold: GoldShape | None = None) -> dict[str, Any] | None:
    """Evidence when the response, outside its reasoning, states more answers than one complete answer
    holds: in ``<answer>`` tags, ``\\boxed{}`` or "Final answer:" lines (and, when the gold states no
    alternatives, "7 or 8" inside one of them); equivalent restatements are one answer (``\\boxed{10^3}``
    and "Final answer: 1,000"; ``2\\pi`` and ``2π``; ``(1, 2)`` and ``x = 1, y = 2``; a tag inside a
    "Final answer:" line; "The capital is Paris." and ``Paris``; ``50%`` and ``0.5``).

    Against ``gold`` (default: one part): when two or more different answers are stated, those left
    after dropping any that only restates parts of another (``\\boxed{1}, \\boxed{2}, so
    \\boxed{(1, 2)}``) are hedging when their parts add up to more than the gold's. So
    ``\\boxed{1}, \\boxed{2}`` for the gold ``\\{1, 2\\}`` is one answer, and ``\\boxed{(1, 2)}`` or
    ``\\boxed{(2, 1)}`` for ``(1, 2)`` is two. Answers stated in prose ("Answer: 44", "the answer is
    44", "It is 44 or 45." as the last line, "Possible answers: 43, 44, 45") count only when an answer
    equal to the gold is stated too: then any other one is hedging. Returns ``{"answers",
    "expected_parts"}`` or None.
    """
    shape = gold or GoldShape()
    raw = _stated_answers(strip_reasoning(completion), shape.boxes)
    strong = [t for t, how in raw if not how]
    if not raw or (len(raw) < 2 and strong and not (shape.split_or and _OR_WORD.search(strong[0]))):
        return None  # the usual case: one answer, nothing to compare
    stated: list[_Stated] = []
    weak_seen = False

    def add(st: _Stated) -> None:
        if not any(st.same(o) for o in stated):
            stated.append(st)

    for a, how in raw[:64]:
        if how:
            for st in _weak_alts(a, how, shape):
                weak_seen = True
                add(st)
            continue
        alts = _top_level_split(a, _OR_SPLIT) if shape.split_or and not shape.whole else [a]
        for alt in alts:
            if st := _stated(alt, shape):
                add(st)
    if len(stated) < 2:
        return None
    gold_st = shape.gold_stated
    has_gold = gold_st is not None and any(st.same(gold_st) for st in stated)
    if weak_seen and has_gold:
        others = [st for st in stated if not st.same(gold_st) and not _restates(st.parts, gold_st.parts)]
        if others:
            return {"answers": sorted(", ".join(st.parts)[:80] for st in stated)[:8], "expected_parts": shape.parts}
    strong_stated: list[_Stated] = []
    for a in strong[:64]:
        for alt in (_top_level_split(a, _OR_SPLIT) if shape.split_or and not shape.whole else [a]):
            if (st := _stated(alt, shape)) and not any(st.same(o) for o in strong_stated):
                strong_stated.append(st)
    answers = [st.parts for st in strong_stated]
    kept = answers if len(answers) > 64 else [p for p in answers if not any(_restates(p, q) for q in answers)]
    if len(answers) > 1 and sum(map(len, kept)) > shape.parts:
        return {"answers": sorted(", ".join(p)[:80] for p in kept)[:8], "expected_parts": shape.parts}
    return None
