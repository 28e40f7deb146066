"""reasoning-gym as a Flywheel domain: every generator with a gold answer and an exact scorer.

Scoring goes through the dataset's own ``score_answer`` (reward 1 only at exactly 1.0), with the
answer taken strictly from ``<answer>…</answer>``. Tasks carry :data:`RECIPE`: a completion cut off at
the token budget earns 0 (``make(recipe=None)`` opts out). Checked by ``tests/shared/test_domains.py`` over 50
items per generator: the gold answer scores 1, another item's answer scores below 1.
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.domains.common import ANSWER_TAG_SYSTEM, TRUNCATION_GATE, split_seed, task_body, with_recipe
from verifier_service.deterministic import LENIENT_SCORERS, SLOW_SCORERS

RECIPE: dict[str, Any] | None = TRUNCATION_GATE
"""Recipe every task carries: an answer tag inside a response cut off at the token budget is not a
finished answer (the reasoning that should have ended in it was cut)."""

EXCLUDED: dict[str, str] = {
    "composite": "a mixture of other generators, not one of its own (use those generators directly)",
    "boxnet": "no gold answer: the scorer checks a plan's validity, not an answer",
    "graph_color": "no gold answer: the scorer checks that a colouring is valid",
    "propositional_logic": "no gold answer: the scorer checks that a derived formula is valid",
    "rubiks_cube": "no gold answer: the scorer simulates the moves",
    "rush_hour": "no gold answer: the scorer simulates the moves",
    "puzzle24": "the scorer accepts expressions over other items' numbers (60 of 60 such answers scored 1.0), "
                "and many answers are right, so no exact comparison with a gold answer is possible either",
}
"""Generators left out, with the reason (measured on 60 items each, seed 7)."""

# How the verifier scores some generators is the verifier's knowledge; re-exported here for the tests
# and benchmarks that pick generators by it.
WRAPPED = LENIENT_SCORERS
SLOW = SLOW_SCORERS


def included() -> list[str]:
    """Names of the generators this domain offers (all of reasoning-gym's, less :data:`EXCLUDED`)."""
    from reasoning_gym.factory import DATASETS

    return sorted(set(DATASETS) - set(EXCLUDED))


def make(n: int, seed: int = 0, split: str = "train", datasets: list[str] | None = None,
         dataset_config: dict[str, dict[str, Any]] | None = None, samples_per_task: int = 8,
         recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """``n`` tasks drawn round-robin from ``datasets`` (default: all :func:`included`), each carrying
    ``recipe`` (default :data:`RECIPE`; ``None``: none, the verifier service's recipe for the domain).

    Raises:
        ValueError: a dataset is excluded or unknown, or ``recipe`` is not a valid recipe.
    """
    import reasoning_gym

    names = datasets or included()
    bad = sorted(set(names) & set(EXCLUDED))
    if bad:
        raise ValueError(f"excluded reasoning-gym generator(s) {bad}: {[EXCLUDED[b] for b in bad]}")
    per = -(-n // len(names))
    out: list[dict] = []
    entries: list[tuple[str, dict]] = []
    for name in names:
        cfg = (dataset_config or {}).get(name, {})
        ds = reasoning_gym.create_dataset(name, size=per * 2 + 4, seed=split_seed(seed, split), **cfg)
        got = 0
        for i in range(len(ds)):
            e = ds[i]
            if e.get("answer") is None:
                continue
            entries.append((name, {"question": e["question"], "answer": str(e["answer"]),
                                   "metadata": _jsonable(e.get("metadata", {}))}))
            got += 1
            if got == per:
                break
    for i, (name, entry) in enumerate(entries):
        # another item's answer from the same generator: what corrupt() submits (never shown to the model)
        others = [x["answer"] for m, x in entries[i + 1:] + entries[:i] if m == name and x["answer"] != entry["answer"]]
        verifier = with_recipe({"kind": "reasoning_gym", "dataset": name, "entry": entry, "extract": "answer_tag"},
                               recipe)
        out.append(task_body("reasoning_gym", split, f"{name}:{entry['question']}", entry["question"], verifier,
                             system=ANSWER_TAG_SYSTEM, samples_per_task=samples_per_task,
                             metadata={"dataset": name, "distractor": others[0] if others else None}))
    random.Random(seed).shuffle(out)
    return out[:n]


def _jsonable(v: Any) -> Any:
    """Metadata as plain JSON (tuples to lists, sets sorted, other objects as text)."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((_jsonable(x) for x in v), key=repr)
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**64:
            return str(v)
        return v
    return str(v)


def gold(task: dict) -> str:
    """The gold answer in answer tags."""
    return f"<answer>{task['verifier']['entry']['answer']}</answer>"


def corrupt(task: dict, rng: random.Random) -> str:
    """A wrong answer: another item's answer from the same generator, else the gold with its first digit
    changed (or a letter appended when it has no digit)."""
    other = task["metadata"].get("distractor")
    if other is not None:
        return f"<answer>{other}</answer>"
    ans = task["verifier"]["entry"]["answer"]
    digits = [i for i, c in enumerate(ans) if c.isdigit()]
    if digits:
        i = digits[0]
        ans = ans[:i] + str((int(ans[i]) + rng.randint(1, 9)) % 10) + ans[i + 1:]
    else:
        ans = ans + " zq"
    return f"<answer>{ans}</answer>"
