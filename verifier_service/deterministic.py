"""Layer 1, deterministic checks that need no process or network: exact, regex, numeric, json_fields,
reasoning_gym and geometry (math and unit_tests run in :mod:`verifier_service.scorers`, which owns
their process pool and sandbox client).

Each function returns a :class:`CheckResult`: the ``correctness`` component in [0, 1] and its
details. A model answer that breaks a scorer is the model's fault (0 with the error in the details);
a failure on our side is ``infra_error`` (``misconfigured`` when the spec itself is wrong). All are
synchronous, thread-safe and never raise on model text.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
import regex

from shared.scene import SceneError, parse_scene, score_scene
from shared.verifier_specs import (
    ExactSpec, FieldSpec, GeometrySpec, JsonFieldsSpec, NumericSpec, ReasoningGymSpec, RegexSpec,
)
from verifier_service.extract import (
    clip, extract_answer, extract_json, normalise_date, parse_number, strip_reasoning,
)


@dataclass
class CheckResult:
    """One layer's outcome: ``score`` in [0, 1], its details, and whether our side failed."""

    score: float
    details: dict[str, Any] = field(default_factory=dict)
    infra_error: bool = False


def ok_if(passed: bool, **details: Any) -> CheckResult:
    """Score 1.0 when ``passed`` else 0.0."""
    return CheckResult(1.0 if passed else 0.0, details)


def infra(reason: str, **details: Any) -> CheckResult:
    """An infrastructure failure: never a score, retried by the service."""
    return CheckResult(0.0, {"reason": reason, **details}, infra_error=True)


# ---------------------------------------------------------------- exact and regex


def score_exact(spec: ExactSpec, completion: str) -> CheckResult:
    """1 when the extracted answer (``spec.extract``; ``full`` = the stripped text after any reasoning
    block) equals the stripped ``spec.answer`` (case-folded unless ``case_sensitive``)."""
    got = extract_answer(strip_reasoning(completion), spec.extract)
    if got is None:
        return ok_if(False, extracted=None, reason=f"no answer found by extract={spec.extract}")
    got, want = got.strip(), spec.answer.strip()
    if not spec.case_sensitive:
        got, want = got.casefold(), want.casefold()
    return ok_if(got == want, extracted=clip(got))


def score_regex(spec: RegexSpec, completion: str, timeout_s: float = 1.0) -> CheckResult:
    """1 when ``regex.search(spec.pattern, …)`` matches the completion outside its reasoning block; the
    match text goes to details.

    A match that runs longer than ``timeout_s`` seconds (catastrophic backtracking on this completion)
    is 0 with the error in the details, like a scorer that raises on a model's answer.
    """
    try:
        m = regex.search(spec.pattern, strip_reasoning(completion), timeout=timeout_s)
    except TimeoutError:
        return ok_if(False, error=f"regex match timed out after {timeout_s} s")
    return ok_if(m is not None, match=clip(m.group(0)) if m else None)


# ---------------------------------------------------------------- numeric


def close_enough(x: float, gold: float, abs_tol: float, rel_tol: float) -> bool:
    """``|x − gold| ≤ max(abs_tol, rel_tol · |gold|)`` (``math.isclose`` with the gold as reference)."""
    return abs(x - gold) <= max(abs_tol, rel_tol * abs(gold))


def score_numeric(spec: NumericSpec, completion: str) -> CheckResult:
    """1 when the extracted number is within ``abs_tol``/``rel_tol`` of ``spec.answer`` (units stripped)."""
    body = strip_reasoning(completion)
    span = body if spec.extract == "last_number" else extract_answer(body, spec.extract)
    if span is None:
        return ok_if(False, extracted=None, reason=f"no answer found by extract={spec.extract}")
    x = parse_number(span, last=True) if spec.extract == "last_number" else parse_number(span, single=True)
    if x is None or not math.isfinite(x):
        return ok_if(False, extracted=clip(span), reason="no number in the answer")
    return ok_if(close_enough(x, spec.answer, spec.abs_tol, spec.rel_tol), value=x)


# ---------------------------------------------------------------- json_fields


def _lookup(obj: Any, path: str) -> tuple[bool, Any]:
    """``obj`` at dotted ``path`` (an exact key wins over a path: ``{"a.b": 1}``)."""
    if isinstance(obj, dict) and path in obj:
        return True, obj[path]
    cur = obj
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return False, None
    return True, cur


def _norm_text(v: Any) -> str | None:
    if isinstance(v, bool) or v is None:
        return None
    return " ".join(str(v).casefold().split()).strip(" .")


_TRUE, _FALSE = {"true", "yes", "y", "1"}, {"false", "no", "n", "0"}


def _as_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    t = _norm_text(v)
    return True if t in _TRUE else False if t in _FALSE else None


def field_matches(fs: FieldSpec, got: Any) -> bool:
    """Whether a model's value ``got`` equals the gold ``fs.value`` under ``fs.type``'s normalisation."""
    if fs.type in ("number", "amount"):
        amount = fs.type == "amount"
        a = parse_number(got, scale_words=amount, single=True, accounting=amount)
        b = parse_number(fs.value, scale_words=amount, single=True, accounting=amount)
        return a is not None and b is not None and close_enough(a, b, fs.abs_tol, fs.rel_tol)
    if fs.type == "date":
        a, b = normalise_date(got, fs.day_first), normalise_date(fs.value, fs.day_first)
        return a is not None and a == b
    if fs.type == "bool":
        a, b = _as_bool(got), _as_bool(fs.value)
        return a is not None and a == b
    if fs.type == "exact":
        return got == fs.value and type(got) is type(fs.value)
    a, b = _norm_text(got), _norm_text(fs.value)
    return a is not None and a == b


def score_json_fields(spec: JsonFieldsSpec, completion: str) -> CheckResult:
    """Weighted fraction of ``spec.fields`` the response's JSON gets right (0 when there is no JSON)."""
    obj, err = extract_json(completion)
    if err is not None:
        return CheckResult(0.0, {"reason": err})
    got_w = total_w = 0.0
    per_field: dict[str, bool] = {}
    for name, fs in spec.fields.items():
        found, val = _lookup(obj, name)
        ok = found and field_matches(fs, val)
        per_field[name] = ok
        total_w += fs.weight
        got_w += fs.weight if ok else 0.0
    wrong = [k for k, v in per_field.items() if not v]
    return CheckResult(got_w / total_w, {"fields": per_field, "wrong": wrong[:50]})


# ---------------------------------------------------------------- geometry


def score_geometry(spec: GeometrySpec, completion: str) -> CheckResult:
    """Weighted fraction of the constraints the response's scene meets (``shared.scene``).

    The scene is ``{"primitives": [...]}`` found like any JSON answer, or a bare list of primitives.
    """
    obj, err = extract_json(completion)
    if err is not None or not (isinstance(obj, dict) and "primitives" in obj):
        body = strip_reasoning(completion)
        tag = extract_answer(body, "answer_tag")
        body = tag if tag is not None else body
        if "[" in body:
            try:
                obj, err = orjson.loads(body[body.index("["): body.rindex("]") + 1]), None
            except (orjson.JSONDecodeError, ValueError):
                pass
    if err is not None:
        return CheckResult(0.0, {"reason": err})
    try:
        prims = parse_scene(obj)
    except SceneError as e:
        return CheckResult(0.0, {"reason": f"invalid scene: {e}"})
    score, results = score_scene(prims, spec.constraints, spec.tolerance)
    if spec.all_or_nothing:
        score = 1.0 if all(r["ok"] for r in results) else 0.0
    return CheckResult(score, {"primitives": len(prims), "constraints": results})


# ---------------------------------------------------------------- reasoning-gym

LENIENT_SCORERS: dict[str, str] = {
    "game_of_life_halting": "its scorer gives 1.0 to any non-empty answer: compared with the gold answer instead",
}
"""reasoning-gym generators whose own scorer accepts wrong answers: scored here by exact comparison with
the gold answer instead (case- and whitespace-folded), with the reason (``flywheel.domains.reasoning_gym``
re-exports these tables as the domain's catalog)."""

TUPLE_METADATA_SCORERS = frozenset({"arc_agi", "rearc"})
"""Generators whose scorer compares the answer with tuples in ``entry["metadata"]``: JSON carries them as
lists, so the verifier turns lists back into tuples before scoring."""

SLOW_SCORERS: dict[str, float] = {"intermediate_integration": 820.0, "simple_integration": 18.0, "codeio": 1.7,
                                  "polynomial_multiplication": 1.7, "sokoban": 1.5}
"""Generators whose scorer takes over a millisecond (measured ms per call): scored in the verifier's
process pool, not inline."""

_rg_cache: dict[str, Any] = {}
_rg_lock = threading.Lock()


def reasoning_gym_dataset(name: str) -> Any:
    """The reasoning-gym dataset ``name`` (size 1, seed 0), created once per process and cached.

    Raises:
        Exception: whatever ``reasoning_gym.create_dataset`` raises for an unknown or broken name.
    """
    ds = _rg_cache.get(name)
    if ds is None:
        with _rg_lock:
            ds = _rg_cache.get(name)
            if ds is None:
                import reasoning_gym

                ds = reasoning_gym.create_dataset(name, size=1, seed=0)
                _rg_cache[name] = ds
    return ds


def reasoning_gym_cached(name: str) -> bool:
    """Whether :func:`reasoning_gym_dataset` would return at once (no dataset construction)."""
    return name in _rg_cache


def _tuples(v: Any) -> Any:
    """``v`` with every list turned into a tuple, recursively (dict values too)."""
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    return v


def score_reasoning_gym(spec: ReasoningGymSpec, completion: str) -> CheckResult:
    """Strictly extract the answer, score it with the dataset's own scorer; 1 only for a score of exactly 1.0.

    Datasets in :data:`LENIENT_SCORERS` compare with the gold answer instead. Blocking the first time
    a dataset is used (its construction can take seconds): call it from a worker thread then. An
    unknown dataset is a misconfiguration: infra_error with ``details.misconfigured``.
    """
    answer = extract_answer(strip_reasoning(completion), spec.extract)
    if answer is None:
        return ok_if(False, extracted=None, reason=f"no answer found by extract={spec.extract}")
    if spec.dataset in LENIENT_SCORERS:
        gold = spec.entry.get("answer")
        if gold is None:
            return infra(f"{spec.dataset}: entry has no gold answer", misconfigured=True)
        return ok_if(_norm_text(answer) == _norm_text(gold), extracted=clip(answer), compared="gold_exact")
    try:
        ds = reasoning_gym_dataset(spec.dataset)
    except Exception as e:  # noqa: BLE001 - any failure here is ours, not the model's
        return infra(f"cannot create reasoning-gym dataset {spec.dataset!r}: {e!r}", misconfigured=True)
    entry = spec.entry
    if spec.dataset in TUPLE_METADATA_SCORERS:
        entry = {**entry, "metadata": _tuples(entry.get("metadata", {}))}
    try:
        raw = ds.score_answer(answer, entry=entry)
    except Exception as e:  # noqa: BLE001 - the model's answer broke the scorer: its fault
        return ok_if(False, extracted=clip(answer), error=clip(f"{type(e).__name__}: {e}"))
    try:
        raw_f = float(raw)
    except (TypeError, ValueError):
        return ok_if(False, extracted=clip(answer), error=f"scorer returned non-number {raw!r}")
    return ok_if(raw_f == 1.0, extracted=clip(answer), raw_score=raw_f)
