"""reasoning-gym as a Flywheel domain: every generator with a gold answer and an exact scorer.

Scoring goes through the dataset's own ``score_answer`` (reward 1 only at exactly 1.0), with the
answer taken strictly from ``<answer>…</answer>``. Tasks carry :data:`RECIPE`: a completion cut off at
the token budget earns 0 (``make(recipe=None)`` opts out). Checked by ``tests/flywheel/test_domains.py`` over 50
items per generator: the gold answer scores 1, another item's answer scores below 1.

:func:`make` mixes generators; :func:`make_dataset` makes the tasks of one generator at one config (a
level of a scheduler domain: ``examples/many_domains.yaml`` has one domain per generator, its levels from
reasoning-gym's own curricula).
"""

from __future__ import annotations

import dataclasses
import json
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
    names = datasets or included()
    bad = sorted(set(names) & set(EXCLUDED))
    if bad:
        raise ValueError(f"excluded reasoning-gym generator(s) {bad}: {[EXCLUDED[b] for b in bad]}")
    per = -(-n // len(names))
    entries: list[tuple[str, dict]] = []
    for name in names:
        entries += _draw(name, per, split_seed(seed, split), (dataset_config or {}).get(name, {}))
    return _bodies(entries, n, seed, split, samples_per_task, recipe)


def make_dataset(n: int, seed: int = 0, split: str = "train", dataset: str = "basic_arithmetic",
                 config: dict[str, Any] | None = None, samples_per_task: int = 8,
                 recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """``n`` tasks of the one generator ``dataset`` built with ``config`` (keyword arguments of its config
    class, e.g. ``{"max_digits": 2}``: a curriculum level), in :func:`make`'s body format. The items have
    distinct questions; a generator with fewer distinct items than ``n`` in ``4n + 16`` draws gives fewer
    tasks. The task ids hash the seed and the config with the question: the same question drawn at two
    levels, or by two seeds, carries other metadata (the level's ranges, another distractor), so it is
    another task, never a conflicting re-registration of one. This is the ``generator`` of a scheduler
    domain (``flywheel.domains.reasoning_gym:make_dataset``, ``params: {dataset: ..., config: {...}}``).

    Raises:
        ValueError: ``dataset`` is excluded or unknown; ``config`` is not a mapping, names a key the
            dataset's config does not have (or ``size``/``seed``, which this sets), or has values the
            dataset rejects (the message names the key when one alone is to blame); ``recipe`` is not a
            valid recipe.
    """
    cfg = check_config(dataset, config)
    try:
        entries = _draw(dataset, n, split_seed(seed, split), cfg, distinct=True)
    except Exception as e:  # a generator can fail on a config its validate() let through
        raise ValueError(f"reasoning-gym {dataset!r} failed to generate with config {cfg}: "
                         f"{type(e).__name__}: {e}") from e
    key = f"{seed}:{json.dumps(cfg, sort_keys=True, default=str)}:"
    return _bodies(entries, n, seed, split, samples_per_task, recipe, key_prefix=key)


def check_config(dataset: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` (``{}`` for ``None``) once the generator ``dataset``'s config class accepts it: it builds
    and its ``validate()`` passes.

    Raises:
        ValueError: as :func:`make_dataset` (unknown or excluded dataset, not a mapping, unknown or
            reserved keys, values the config rejects).
    """
    from reasoning_gym.factory import DATASETS

    if dataset in EXCLUDED:
        raise ValueError(f"excluded reasoning-gym generator {dataset!r}: {EXCLUDED[dataset]}")
    if dataset not in DATASETS:
        raise ValueError(f"unknown reasoning-gym generator {dataset!r}; known: {included()}")
    if not isinstance(config, (dict, type(None))):
        raise ValueError(  # noqa: TRY004 - a bad config, like any other (the scheduler reports ValueErrors)
            f"reasoning-gym {dataset!r}: config must be a mapping, not {type(config).__name__}")
    cfg = dict(config or {})
    cls = DATASETS[dataset][1]
    fields = {f.name for f in dataclasses.fields(cls)} - {"size", "seed"}
    unknown = sorted(set(cfg) - fields)
    if unknown:
        why = " (size and seed are set by make_dataset)" if set(unknown) & {"size", "seed"} else ""
        raise ValueError(f"reasoning-gym {dataset!r}: unknown config key(s) {unknown}{why}; "
                         f"known: {sorted(fields)}")
    error = _config_error(cls, cfg)
    if error is not None:
        blamed = [k for k in cfg if _config_error(cls, {x: v for x, v in cfg.items() if x != k}) is None]
        which = (f" (key {blamed[0]!r} = {cfg[blamed[0]]!r})" if len(blamed) == 1
                 else f" (keys {blamed} together)" if blamed else "")
        raise ValueError(f"reasoning-gym {dataset!r} rejects config {cfg}{which}: {error}")
    return cfg


def _config_error(cls: type, cfg: dict[str, Any]) -> str | None:
    """Why the config class ``cls`` refuses ``cfg`` (construction or ``validate()``), or None."""
    try:
        obj = cls(**cfg)
        if hasattr(obj, "validate"):
            obj.validate()
    except Exception as e:  # noqa: BLE001 - reasoning-gym asserts (AssertionError), compares wrong types (TypeError)
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return None


def _draw(name: str, per: int, ds_seed: int, cfg: dict[str, Any], distinct: bool = False) -> list[tuple[str, dict]]:
    """Up to ``per`` items of generator ``name`` that have an answer (``distinct``: distinct questions, from
    ``4·per + 16`` draws; else from ``2·per + 4``)."""
    import reasoning_gym

    size = per * 4 + 16 if distinct else per * 2 + 4
    ds = reasoning_gym.create_dataset(name, size=size, seed=ds_seed, **cfg)
    out: list[tuple[str, dict]] = []
    seen: set[str] = set()
    for i in range(len(ds)):
        if len(out) == per:
            break
        e = ds[i]
        if e.get("answer") is None or (distinct and e["question"] in seen):
            continue
        seen.add(e["question"])
        out.append((name, {"question": e["question"], "answer": str(e["answer"]),
                           "metadata": _jsonable(e.get("metadata", {}))}))
    return out


def _bodies(entries: list[tuple[str, dict]], n: int, seed: int, split: str, samples_per_task: int,
            recipe: dict[str, Any] | None, key_prefix: str = "") -> list[dict]:
    """Task bodies of ``entries`` (``(generator, entry)`` pairs), shuffled by ``seed``, at most ``n``; the
    task id hashes ``key_prefix``, the generator and the question."""
    out: list[dict] = []
    for i, (name, entry) in enumerate(entries):
        # another item's answer from the same generator: what corrupt() submits (never shown to the model)
        others = [x["answer"] for m, x in entries[i + 1:] + entries[:i] if m == name and x["answer"] != entry["answer"]]
        verifier = with_recipe({"kind": "reasoning_gym", "dataset": name, "entry": entry, "extract": "answer_tag"},
                               recipe)
        out.append(task_body("reasoning_gym", split, f"{key_prefix}{name}:{entry['question']}", entry["question"],
                             verifier, system=ANSWER_TAG_SYSTEM, samples_per_task=samples_per_task,
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
