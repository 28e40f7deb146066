"""Any reasoning-gym generator as a Flywheel environment: Flywheel's own domain through the public API.

The rows are reasoning-gym's items (``reasoning_gym.create_dataset``): the question, the gold answer, and the
item's metadata in ``info``. The one reward takes the answer out of the completion the way Flywheel's built-in
``reasoning_gym`` verifier kind does and scores it with the generator's own ``score_answer``, a pass only at
exactly 1.0; the raw score is reported beside it. ``tests/flywheel/test_reasoning_gym_env.py`` checks that the
two give the same reward.

This is user code: it imports ``flywheel.env``, ``shared`` and reasoning-gym, nothing of the services. The few rules of the
built-in kind it needs (answer extraction, the generators scored another way) are restated here, each saying
which rule of ``verifier_service`` it mirrors.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal

from flywheel.env import Environment, Rubric
from shared.envs.tasks import norm_text

ANSWER_TAG_SYSTEM = ("Solve the problem. You may reason first, then give only the final answer inside "
                     "<answer></answer> tags.")
"""The system prompt of Flywheel's reasoning-gym domain (``flywheel.domains.common.ANSWER_TAG_SYSTEM``)."""

EVAL_SEED_OFFSET = 1_000_003
"""Held-out items are drawn with ``seed`` plus this, as the built-in task makers draw their eval split."""

LENIENT_SCORERS = frozenset({"game_of_life_halting"})
"""Generators whose own scorer accepts wrong answers: compared with the gold answer instead, case- and
whitespace-folded (mirrors ``verifier_service.deterministic.LENIENT_SCORERS``)."""

TUPLE_METADATA_SCORERS = frozenset({"arc_agi", "rearc"})
"""Generators whose scorer compares the answer with tuples in the metadata, which JSON carries as lists: turned
back into tuples before scoring (mirrors ``verifier_service.deterministic.TUPLE_METADATA_SCORERS``)."""


# ---------------------------------------------------------------- answer extraction (the built-in kind's rules)

def strip_reasoning(text: str) -> str:
    """The part of ``text`` after its last ``</think>``, cut at a ``<think>`` never closed (mirrors
    ``verifier_service.extract.strip_reasoning``)."""
    close = text.rfind("</think>")
    body = text[close + len("</think>"):] if close >= 0 else text
    open_ = body.find("<think>")
    return body[:open_] if open_ >= 0 else body


_NUMBER = re.compile(r"(?:(?<![\w)\]}.])-)?\d(?:[\d,]*\d)?(?:\.\d+)?")
_TAG_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_TAG_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)
_BRACES = re.compile(r"\\boxed\{|\{|\}")


def _last_answer_tag(text: str) -> str | None:
    """Stripped content of the last ``<answer>…</answer>`` (tags case-insensitive, blanks allowed inside them,
    the innermost opening tag before a closing one; mirrors ``verifier_service.extract.extract_answer_tag``)."""
    last, i = None, 0
    while (a := _TAG_OPEN.search(text, i)) is not None:
        b = _TAG_CLOSE.search(text, a.end())
        if b is None:
            break
        while (n := _TAG_OPEN.search(text, a.end(), b.start())) is not None:
            a = n
        last, i = text[a.end():b.start()], b.end()
    return None if last is None else last.strip()


def _last_boxed(text: str) -> str | None:
    """Stripped content of the last balanced ``\\boxed{…}`` by start (mirrors
    ``verifier_service.extract.extract_boxed``)."""
    stack: list[int] = []
    found: list[tuple[int, int]] = []
    for m in _BRACES.finditer(text):
        if m.group(0) == "}":
            if stack and (start := stack.pop()) >= 0:
                found.append((start, m.end()))
        else:
            stack.append(m.start() if m.group(0) != "{" else -1)
    if not found:
        return None
    a, b = max(found)
    return text[a + len("\\boxed{"):b - 1].strip()


def extract_answer(completion: str, how: str) -> str | None:
    """The answer of ``completion`` by ``how``, after any reasoning block, or None when there is none: the
    rule of the built-in kind's ``extract`` (``verifier_service.extract.extract_answer`` after
    ``strip_reasoning``): ``answer_tag`` the last ``<answer>`` tag, ``last_number`` the last number (thousands
    commas removed, a minus only as a sign), ``boxed`` the last ``\\boxed{}``, ``full`` the stripped text."""
    text = strip_reasoning(completion)
    if how == "answer_tag":
        return _last_answer_tag(text)
    if how == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    if how == "boxed":
        return _last_boxed(text)
    return text.strip() or None


# ---------------------------------------------------------------- rows


def jsonable(v: Any) -> Any:
    """``v`` as plain JSON: numpy scalars and arrays as Python numbers and lists (they are kept as numbers, not
    text, so a scorer reading them gets the same values), tuples as lists, sets sorted, other objects as text."""
    if hasattr(v, "tolist") and callable(v.tolist):  # numpy arrays and scalars, without importing numpy
        v = v.tolist()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((jsonable(x) for x in v), key=repr)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**64:
        return str(v)  # past what JSON readers keep exactly
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


def _rows(dataset: str, n: int, seed: int, config: dict[str, Any], skip: set[str]) -> list[dict[str, Any]]:
    """``n`` rows of distinct questions not in ``skip`` (``skip`` gets theirs), from ``4n + 64`` draws.

    Raises:
        ValueError: the generator gives fewer than ``n`` such questions.
    """
    import reasoning_gym

    ds = reasoning_gym.create_dataset(dataset, size=4 * n + 64, seed=seed, **config)
    rows = []
    for entry in ds:
        if len(rows) == n:
            break
        key = norm_text(entry["question"])  # what makes two prompts the same prompt for Flywheel
        if key in skip:
            continue
        skip.add(key)
        answer = entry.get("answer")
        rows.append({"question": entry["question"], "answer": None if answer is None else str(answer),
                     "info": {"dataset": dataset, "metadata": jsonable(entry.get("metadata", {}))}})
    if len(rows) < n:
        raise ValueError(f"reasoning-gym {dataset!r} with config {config}: only {len(rows)} distinct questions "
                         f"for {n} asked (seed {seed})")
    return rows


# ---------------------------------------------------------------- the environment


def _tuples(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    return v


def _folded(v: Any) -> str | None:
    return None if v is None or isinstance(v, bool) else " ".join(str(v).casefold().split()).strip(" .")


def load_environment(dataset: str = "basic_arithmetic", size: int = 1000, seed: int = 0, eval_size: int = 0,
                     config: dict[str, Any] | None = None, system_prompt: str | None = ANSWER_TAG_SYSTEM,
                     extract: Literal["answer_tag", "last_number", "boxed", "full"] = "answer_tag") -> Environment:
    """The reasoning-gym generator ``dataset`` as an environment.

    Args:
        dataset: a reasoning-gym generator name (``reasoning_gym.factory.DATASETS``).
        size: training rows (distinct questions, none of them a held-out question).
        seed: the generator's seed; held-out rows use ``seed`` + :data:`EVAL_SEED_OFFSET`.
        eval_size: held-out rows (the environment's ``eval_dataset``); 0: none, the driver or scheduler holds
            out rows of the dataset itself.
        config: keyword arguments of the generator's config class (its difficulty knobs), e.g.
            ``{"min_digits": 1, "max_digits": 1}``.
        system_prompt: the system message; the default asks for the answer in ``<answer>`` tags, as Flywheel's
            reasoning-gym domain does. Say what ``extract`` reads.
        extract: how the answer is taken from a completion (the built-in kind's ``extract``).

    Raises:
        ValueError: unknown generator, extraction or config key, or too few distinct questions.
        Exception: whatever reasoning-gym raises for config values its generator refuses.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; known: {sorted(DATASETS)}")
    if extract not in ("answer_tag", "last_number", "boxed", "full"):
        raise ValueError(f"unknown extract {extract!r}: answer_tag, last_number, boxed or full")
    config = dict(config or {})
    known = {f.name for f in dataclasses.fields(DATASETS[dataset][1])} - {"size", "seed"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"reasoning-gym {dataset!r}: unknown config key(s) {unknown} (size and seed are this "
                         f"function's own arguments); known: {sorted(known)}")
    seen: set[str] = set()
    held = _rows(dataset, eval_size, seed + EVAL_SEED_OFFSET, config, seen) if eval_size > 0 else None
    rows = _rows(dataset, size, seed, config, seen)
    scorer = reasoning_gym.create_dataset(dataset, size=1, seed=seed, **config)  # for its score_answer

    def correct(completion: str, answer: Any, info: dict, prompt: list) -> dict:
        """1.0 when the generator's own ``score_answer`` gives exactly 1.0 to the extracted answer, else 0
        (no partial credit, as the built-in kind); ``raw_score`` is what the scorer gave (0 when no answer was
        found or the answer broke the scorer, which is the model's fault, as in the built-in kind)."""
        got = extract_answer(completion, extract)
        if got is None:
            return {"score": 0.0, "answered": 0.0, "raw_score": 0.0}
        if dataset in LENIENT_SCORERS:
            passed = answer is not None and _folded(got) == _folded(answer)
            return {"score": float(passed), "answered": 1.0, "raw_score": float(passed)}
        metadata = info.get("metadata", {})
        entry = {"question": prompt[-1]["content"] if prompt else "", "answer": answer,
                 "metadata": _tuples(metadata) if dataset in TUPLE_METADATA_SCORERS else metadata}
        try:
            raw = float(scorer.score_answer(got, entry=entry))
        except Exception:  # noqa: BLE001 - the model's answer broke the scorer (or it gave a non-number): a 0
            raw = 0.0
        raw = raw if math.isfinite(raw) else 0.0
        return {"score": float(raw == 1.0), "answered": 1.0, "raw_score": raw}

    return Environment(dataset=rows, eval_dataset=held, rubric=Rubric([correct]), system_prompt=system_prompt,
                       name=dataset)
