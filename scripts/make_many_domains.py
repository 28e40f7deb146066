"""Write examples/many_domains.yaml: every shipped domain as a scheduler domain, each reasoning-gym
generator on its own with its levels from reasoning-gym's curricula.

    python scripts/make_many_domains.py [--out examples/many_domains.yaml]

What it writes:

* one domain per generator of :func:`flywheel.domains.reasoning_gym.included` (named after it), with
  ``generator: flywheel.domains.reasoning_gym:make_dataset`` and ``params: {dataset: <name>}``. Its levels
  come from the generator's curriculum (``reasoning_gym.factory.create_curriculum``): level i sets every
  attribute of the curriculum to level min(i, its last level) (``set_global_level``) and takes the
  config reasoning-gym's ``generate_configuration`` makes of it (a range attribute spans its level 0 to
  its level i), as ``params: {config: {...}}``; up to :data:`MAX_LEVELS` distinct levels, with an
  adaptive curriculum when there are two or more. A generator without a curriculum has one level (its
  default config);
* the other shipped domains (``humaneval``, ``humaneval_repair``, ``gsm_symbolic_math`` (the module
  ``flywheel.domains.gsm_symbolic``: the name ``gsm_symbolic`` is the reasoning-gym generator's),
  ``financial_extraction``, ``geometry``, ``toy``: :data:`SHIPPED`), with ``generator:
  flywheel.domains.<module>``.

Every level is checked before it is written: the generator makes 2 tasks with it within
:data:`CHECK_LIMIT_S` (a level that fails is dropped and the reason printed; a domain whose level 0
fails gets its default config). Then it times
what the scheduler generates at start-up (every domain's level-0 training tasks and its held-out tasks)
and prints it. The file's header says it is generated; edit this script, not the YAML.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: the repository's packages first

from scheduler_service.config import DomainConfig

DEFAULT_OUT = ROOT / "examples/many_domains.yaml"
RG = "flywheel.domains.reasoning_gym:make_dataset"
MAX_LEVELS = 3
TASKS_PER_LEVEL = 8
"""Training tasks the scheduler generates per level: small, so the start-up generation stays quick."""
EVAL_SIZE = 2
"""Held-out tasks per domain (greedy, at level 0)."""
SAMPLES = 4
"""K of every domain's groups (2 for the multi-turn one)."""

WEIGHTS = {
    # small-integer arithmetic: what SmolLM2-135M learns in a short CPU run (examples/arithmetic.yaml)
    "basic_arithmetic": 3.0, "chain_sum": 3.0, "products": 2.0,
    # slow to score (math-verify on integrals and polynomials, a Sokoban simulation, running code)
    "codeio": 0.25, "intermediate_integration": 0.25, "polynomial_multiplication": 0.25,
    "simple_integration": 0.25, "sokoban": 0.25,
    # sandbox runs: every sample runs the tests; the repair loop runs them up to 3 times per sample
    "humaneval": 0.5, "humaneval_repair": 0.25,
}
"""Weights other than 1.0 (share of the training groups relative to the other domains)."""

SHIPPED: dict[str, dict[str, Any]] = {
    # the reasoning-gym generator gsm_symbolic is a domain of its own (exact score of the answer tag); this
    # one is the same problems scored by math-verify on \boxed{}. Only difficulty 1.0 exists: one level
    "gsm_symbolic_math": {"generator": "flywheel.domains.gsm_symbolic"},
    "financial_extraction": {"generator": "flywheel.domains.financial_extraction", "max_tokens": 160},
    "geometry": {"generator": "flywheel.domains.geometry", "max_tokens": 192,
                 "levels": [{"name": "tower", "params": {"families": ["tower"]}},
                            {"name": "tower+row", "params": {"families": ["tower", "row"]}},
                            {"name": "all", "params": {"families": ["tower", "row", "table"]}}],
                 "curriculum": {"mode": "adaptive"}},
    "humaneval": {"generator": "flywheel.domains.humaneval", "params": {"eval_size": 32}, "max_tokens": 160},
    "humaneval_repair": {"generator": "flywheel.domains.humaneval_repair", "params": {"eval_size": 32, "max_turns": 3},
                         "max_tokens": 160, "samples_per_task": 2},
    "toy": {"generator": "flywheel.domains.toy", "max_tokens": 8,
            "levels": [{"params": {"pattern": p}} for p in ("^[a-z]", "^[a-z]{2}", "^[a-z]{3}")],
            "curriculum": {"mode": "adaptive"}},
}
"""The other shipped domains. ``max_tokens`` where 64 tokens cannot hold an answer (a JSON object, a scene,
a function); human-eval's ``eval_size`` param is the size of its held-out pool (the last 32 problems),
not of the domain's held-out set. The toy patterns are :data:`flywheel.domains.toy.LEVELS`."""


def load_generator(spec: str):
    """The function of a ``module[:function]`` generator spec (default function ``make``).

    Raises:
        ImportError: the module does not import. AttributeError: it has no such function.
    """
    module, _, fn = spec.partition(":")
    return getattr(importlib.import_module(module), fn or "make")


def _plain(v: Any) -> Any:
    """``v`` as plain YAML data (tuples to lists, numpy scalars to Python numbers)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        return v.item()
    return v


def curriculum_configs(name: str) -> list[dict[str, Any]]:
    """The configs of generator ``name``'s first :data:`MAX_LEVELS` curriculum levels, distinct, easiest
    first (``[]``: it has no curriculum). Only the curriculum's attributes' fields are kept."""
    from reasoning_gym.coaching.attributes import RangeAttributeDefinition
    from reasoning_gym.factory import CURRICULA, create_curriculum

    if name not in CURRICULA:
        return []
    cur = create_curriculum(name)
    out: list[dict[str, Any]] = []
    for level in range(MAX_LEVELS):
        cur.set_global_level(level)
        cfg = cur.generate_configuration()
        fields = [f for a in cur.attributes.values()
                  for f in ((a.lower_field_name, a.upper_field_name) if isinstance(a, RangeAttributeDefinition)
                            else (a.field_name,))]
        d = _plain({f: getattr(cfg, f) for f in fields})
        if d not in out:
            out.append(d)
    return out


CHECK_LIMIT_S = 20.0
"""Longest the check of one level (2 tasks) may take: a level slower than that would hold up the scheduler,
which makes :data:`TASKS_PER_LEVEL` tasks at a time (on 2 loaded cores the slowest kept level took about
7 s; sokoban's curriculum level 0 and jugs' level 2 took over 60 s)."""
CHECK_SECONDS: dict[str, float] = {}
"""Seconds each check took, by ``generator params`` (printed with ``--verbose``)."""


class _Slow(BaseException):
    """Raised by the check's timer; not an ``Exception``, so no generator's error handling wraps it."""


def check(generator: str, params: dict[str, Any], n: int = 2, limit_s: float | None = None) -> str | None:
    """Why ``generator`` cannot make ``n`` training tasks with ``params`` (None: it can): it raises, makes
    none, or takes longer than ``limit_s`` seconds (default :data:`CHECK_LIMIT_S`; a SIGALRM timer, so
    call it from the main thread). The time it took goes to :data:`CHECK_SECONDS`."""
    import signal

    def _alarm(*_):
        raise _Slow

    limit = CHECK_LIMIT_S if limit_s is None else limit_s
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        tasks = load_generator(generator)(n, seed=0, split="train", **params)
    except _Slow:
        return f"too slow: {n} tasks took over {limit:.0f} s"
    except Exception as e:  # noqa: BLE001 - any failure of a level is reported and the level dropped
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        CHECK_SECONDS[f"{generator} {_flow(params)}"] = time.perf_counter() - t0
    return None if tasks else "no tasks"


def _short(why: str) -> str:
    """A check's failure as a YAML comment: the reasoning-gym reason, without the config it repeats."""
    import re

    why = re.sub(r"^ValueError: reasoning-gym '[^']+' (rejects|failed to generate with) config \{[^}]*\}",
                 lambda m: "the config rejects it" if m[1] == "rejects" else "it fails", why)
    return why[:160]


def reasoning_gym_domain(name: str) -> tuple[dict[str, Any], list[str]]:
    """Domain ``name`` (one reasoning-gym generator) and notes on the levels dropped."""
    notes: list[str] = []
    kept: list[dict[str, Any]] = []
    for i, cfg in enumerate(curriculum_configs(name)):
        why = check(RG, {"dataset": name, "config": cfg})
        if why is None:
            kept.append(cfg)
            continue
        notes.append(f"curriculum level {i} {_flow(cfg)} dropped: {_short(why)}")
        if i == 0:
            notes.append("its level 0 fails, so one level: the default config")
            kept = []
            break
    d: dict[str, Any] = {"generator": RG, "params": {"dataset": name}}
    if kept:
        d["levels"] = [{"params": {"config": c}} for c in kept]
    elif (why := check(RG, d["params"])) is not None:
        notes.append(f"WARNING: the default config fails too: {_short(why)}")
    if len(kept) >= 2:
        d["curriculum"] = {"mode": "adaptive"}
    return d, notes


def shipped_domain(name: str) -> tuple[dict[str, Any], list[str]]:
    """Domain ``name`` of :data:`SHIPPED`, with its levels checked (a failing one is dropped)."""
    d = dict(SHIPPED[name])
    cfg = DomainConfig.model_validate(d)
    notes, levels = [], []
    for i, lv in enumerate(d.get("levels") or [None]):
        why = check(d["generator"], cfg.level_params(i))
        if why is None:
            levels.append(lv)
        else:
            notes.append(f"level {i} dropped: {_short(why)}")
    if d.get("levels"):
        d["levels"] = levels
        if len(levels) < 2:
            d.pop("curriculum", None)
        if not levels:
            d.pop("levels")
    return d, notes


KEY_ORDER = ("weight", "generator", "params", "levels", "curriculum", "tasks_per_level", "eval_size",
             "samples_per_task", "max_tokens")


def build(verbose: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """Every domain (reasoning-gym generators, sorted, then :data:`SHIPPED`) with the common settings,
    keys in :data:`KEY_ORDER`, and the notes on levels dropped by domain (``verbose``: print each domain's
    check time as it goes).

    Raises:
        pydantic.ValidationError: a domain the scheduler's ``DomainConfig`` would refuse.
    """
    from flywheel.domains.reasoning_gym import included

    domains: dict[str, dict[str, Any]] = {}
    notes: dict[str, list[str]] = {}
    for name in [*included(), *SHIPPED]:
        t0 = time.perf_counter()
        d, notes[name] = reasoning_gym_domain(name) if name not in SHIPPED else shipped_domain(name)
        if verbose:
            print(f"  {name}: {len(d.get('levels') or [None])} level(s) checked in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        full = {"weight": WEIGHTS.get(name, 1.0), "tasks_per_level": TASKS_PER_LEVEL, "eval_size": EVAL_SIZE,
                "samples_per_task": SAMPLES, **d}
        domains[name] = {k: full[k] for k in KEY_ORDER if k in full}
        assert set(domains[name]) == set(full), sorted(set(full) - set(KEY_ORDER))
        DomainConfig.model_validate(domains[name])  # what the scheduler will accept
    return domains, notes


def startup_seconds(domains: dict[str, dict[str, Any]], verbose: bool = False) -> dict[str, float]:
    """Seconds each domain's generator takes for what the scheduler makes at start-up: the level-0 training
    tasks (``tasks_per_level``) and the held-out ones (``eval_size`` at ``eval_level``).

    Raises:
        Exception: whatever a generator raises (every level was checked before).
    """
    out = {}
    for name, raw in domains.items():
        cfg = DomainConfig.model_validate(raw)
        fn = load_generator(cfg.generator)
        t0 = time.perf_counter()
        fn(cfg.tasks_per_level, seed=0, split="train", **cfg.level_params(cfg.level))
        if cfg.eval_size:
            fn(cfg.eval_size, seed=0, split="eval", **cfg.level_params(cfg.eval_level))
        out[name] = time.perf_counter() - t0
        if verbose:
            print(f"  {name}: start-up tasks made in {out[name]:.1f} s", flush=True)
    return out


HEADER = """\
# GENERATED by scripts/make_many_domains.py: do not edit by hand; change the script and regenerate with
#   python scripts/make_many_domains.py
# Run it (a short run: 3 steps of 8 groups, on CPU):
#   flywheel run examples/many_domains.yaml --report runs/many_domains.json
#
# {n_domains} domains, {n_levels} levels: every reasoning-gym generator Flywheel includes
# (flywheel.domains.reasoning_gym.included()) as a domain of its own, its levels taken from
# reasoning-gym's curriculum for it (level i: every attribute at level min(i, its last), up to {max_levels};
# adaptive when there are two or more), plus humaneval, humaneval_repair (multi-turn, sandbox tools),
# gsm_symbolic_math (flywheel.domains.gsm_symbolic: reasoning-gym's gsm_symbolic scored by math-verify),
# financial_extraction, geometry and toy (3 regex levels). No task is submitted (tasks.kind: none): the
# scheduler calls each domain's generator for {tasks_per_level} training tasks when the domain enters a level
# and {eval_size} held-out tasks at level 0, and mixes the domains by weight. Weights: 1 but for
# small-integer arithmetic (3, 2: what SmolLM2-135M learns in a CPU run), the generators slow to score
# (0.25: math-verify on integrals and polynomials, Sokoban, code execution) and human-eval (0.5; the
# repair loop 0.25: it runs the tests in the sandbox up to 3 times per sample).
"""

REST = """\
model:
  name: smollm2-135m-instruct
run:
  dir: runs
tasks:
  kind: none   # the scheduler generates every task from domains.<d>.generator
budget:   # shared by the scheduler (issue) and the trainer (consume)
  batch_groups: 8
  max_steps: 3
scheduler:
  max_tokens: 64   # per domain where an answer needs more (JSON, scenes, functions) or less (toy)
  eval_before_training: true
rollout:
  engine: torch
  max_batch_samples: 32
  max_trajectory_tokens: 900   # humaneval_repair: its turns and the test output, as examples/humaneval_repair.yaml
  tool_timeout_s: 10
trainer:
  loss: bnpo   # token mean over the batch
  truncation: mask
verifier:
  math_workers: 1
  recipes:   # for the domains whose tasks carry no recipe of their own (as examples/mixture.yaml)
    financial_extraction:
      rules: [{rule: format, answer_tag: true}]
      weights: {correctness: 0.9, format: 0.1}
    geometry:
      rules: [{rule: format, answer_tag: true}]
      gates: [format]
"""


def _flow(v: Any) -> str:
    """``v`` as one line of YAML flow style."""
    text = yaml.safe_dump(v, default_flow_style=True, sort_keys=False, width=1 << 30)
    return text.removesuffix("...\n").strip()


def render(domains: dict[str, dict[str, Any]], notes: dict[str, list[str]] | None = None) -> str:
    """The YAML text: :data:`HEADER`, :data:`REST`, then ``domains`` one key per line, levels one per line,
    each domain's ``notes`` as comments above it."""
    n_levels = sum(len(d.get("levels") or [None]) for d in domains.values())
    lines = [HEADER.format(n_domains=len(domains), n_levels=n_levels, max_levels=MAX_LEVELS,
                           tasks_per_level=TASKS_PER_LEVEL, eval_size=EVAL_SIZE), REST, "domains:"]
    for name, d in domains.items():
        lines += [f"  # {note}" for note in (notes or {}).get(name, [])]
        lines.append(f"  {name}:")
        for k, v in d.items():
            if k == "levels":
                lines.append("    levels:")
                lines += [f"      - {_flow(lv)}" for lv in v]
            else:
                lines.append(f"    {k}: {_flow(v)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Build, check, time and write the file; print the levels dropped and the timings. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--verbose", action="store_true", help="print each domain's and level's check time")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    domains, notes = build(args.verbose)
    checked = time.perf_counter() - t0
    for name, ns in notes.items():
        for note in ns:
            print(f"{name}: {note}")
    if args.verbose:
        for k, v in sorted(CHECK_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  slowest checks: {v:.2f} s {k}")
    n_levels = sum(len(d.get("levels") or [None]) for d in domains.values())
    print(f"{len(domains)} domains, {n_levels} levels; checking every level (2 tasks each) took {checked:.1f} s")
    times = startup_seconds(domains, args.verbose)
    slow = sorted(times.items(), key=lambda kv: -kv[1])[:8]
    print(f"start-up generation (level-0 train x{TASKS_PER_LEVEL} + eval x{EVAL_SIZE}, every domain): "
          f"{sum(times.values()):.1f} s; slowest: " + ", ".join(f"{k} {v:.2f} s" for k, v in slow))
    args.out.write_text(render(domains, notes))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
