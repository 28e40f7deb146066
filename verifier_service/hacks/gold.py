"""The shape of a task's gold answer: what one complete answer holds, which tells a multi-part
answer from hedging (:func:`verifier_service.hacks.hedging.multiple_answers`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shared.verifier_specs import ExactSpec, GeometrySpec, JsonFieldsSpec, MathSpec, NumericSpec, ReasoningGymSpec
from verifier_service.extract import boxed_contents
from verifier_service.hacks.answers import (_LATEX_SPACING, _NAMED, _OR_WORD, _PART_SEP, _answer_parts, _clean,
                                            _top_level_split, _unwrap, _values, _whole)


@dataclass(frozen=True)
class GoldShape:
    """What one complete answer of a task looks like: tells a multi-part answer from hedging."""

    parts: int = 1
    """Parts of one complete answer: the gold's top-level items (``(1, 2)``, ``\\{1, 2\\}`` and
    ``k = 45 and n = 2`` have 2; ``1,234`` has 1)."""
    whole: bool = False
    """Answers are structured (a JSON object, a scene): each stated answer is one part, never split."""
    split_or: bool = False
    """The gold states no alternatives, so ``7 or 8`` inside one answer is two answers."""
    item_groups: bool = False
    """The gold is a list of bracketed items (``(2, 1), (1, 2)``): a bracketed answer is one item."""
    boxes: bool = True
    """``\\boxed{}`` marks answers (not so where the answer is read from ``<answer>`` tags only)."""
    gold_values: tuple[float, ...] = ()
    """The gold's numeric value (:func:`_values`), when it has one."""
    gold_words: int = 1
    """Words in the gold (bounds how long a prose answer may be to be read as one)."""
    gold_stated: Any = None
    """The gold read as a stated answer (:class:`_Stated`): what equals it is the gold."""


def gold_parts(gold: str) -> int:
    """How many parts the gold answer ``gold`` has (at least 1; see :func:`_answer_parts`)."""
    return max(1, len(_answer_parts(gold)[1]))


def _item_groups(gold: str) -> bool:
    """Whether ``gold`` is a list of two or more bracketed items, not one bracketed whole."""
    t = _LATEX_SPACING.sub(" ", gold).strip().rstrip(".").strip().replace("\\{", "{").replace("\\}", "}")
    if _unwrap(t)[0] != t:
        return False
    items = _top_level_split(t, _PART_SEP)
    return len(items) > 1 and all(_unwrap(i)[0] != i for i in items)


def gold_shape(spec: Any) -> GoldShape | None:
    """The answer shape a task's verifier spec expects, from its gold; None when the kind has no gold
    answer (``regex``, ``unit_tests``): then any two different answers count as hedging."""
    if isinstance(spec, (JsonFieldsSpec, GeometrySpec)):
        return _WHOLE
    if isinstance(spec, (MathSpec, ExactSpec)):
        gold = spec.answer
    elif isinstance(spec, NumericSpec):
        gold = repr(spec.answer)
    elif isinstance(spec, ReasoningGymSpec):
        gold = str(spec.entry.get("answer", ""))
    else:
        return None
    return _shape_of(gold, getattr(spec, "extract", None) != "answer_tag")


_WHOLE = GoldShape(whole=True)


@lru_cache(maxsize=4096)
def _shape_of(gold: str, boxes: bool) -> GoldShape:
    """:class:`GoldShape` of a gold text (cached: a task's K samples and its retries share it)."""
    shape = GoldShape(parts=gold_parts(gold), split_or=not _OR_WORD.search(gold), item_groups=_item_groups(gold),
                      boxes=boxes, gold_values=_values(gold) if gold_parts(gold) == 1 else (),
                      gold_words=len(gold.split()))
    return dataclasses.replace(shape, gold_stated=_stated(gold, shape))


@dataclass(frozen=True)
class _Stated:
    """One stated answer as the hedging detector compares it."""

    key: str
    parts: tuple[str, ...]
    flat: str  # the parts' values without their names: (1, 2) and x = 1, y = 2 alike
    values: tuple[float, ...]
    text: str  # the cleaned text, casefolded, spaces collapsed

    def same(self, o: "_Stated") -> bool:
        """Whether the two state one answer: equal keys or values, or a sentence ending in the other
        ("The capital is Paris" and "Paris")."""
        if self.key == o.key or (self.flat and self.flat == o.flat):
            return True
        if self.values and o.values and any(abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
                                            for a in self.values for b in o.values):
            return True
        a, b = self.text, o.text
        return bool(a and b) and any(x.endswith(f" is {y}") or x.endswith(f": {y}") for x, y in ((a, b), (b, a)))


def _stated(text: str, shape: GoldShape) -> _Stated | None:
    if shape.whole:
        c = _whole(text)
        return _Stated(c, (c,), c, (), "") if c else None
    clean = _clean(text)
    key, parts = _answer_parts(clean, shape.item_groups)
    if not key:
        return None
    flat = "\x1f".join(p.rsplit(_NAMED, 1)[-1] for p in parts)
    boxed = boxed_contents(clean)
    vals = _values(boxed[0] if boxed else clean) if len(parts) <= 1 or not shape.item_groups else ()
    return _Stated(key, parts, flat, vals, re.sub(r"\s+", " ", clean).casefold())
