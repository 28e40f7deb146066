"""The estimate of ``flywheel budget``: trajectories × rounds × tokens per round per domain and split
(:func:`estimate`), the even-pace learning model over the pilot's measurements (:func:`_pilot_estimates`),
and the whole report of the command (:func:`budget_report`, its ``--json``)."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any

from flywheel.budget.costs import Cost
from flywheel.budget.pilot import Pilot
from flywheel.budget.trajectories import (EVAL, TRAIN, Counts, eval_round_versions, issued_training_groups,
                                          plan_counts)


def _line(domain: str, split: str, trajectories: float, c: Cost | None, tokens_per_traj: float | None = None) -> dict:
    """One output row: the formula's terms and totals (``None`` where the cost is unknown)."""
    tpt = c.tokens if tokens_per_traj is None and c is not None else tokens_per_traj
    if c is None or tpt is None:
        return {"domain": domain, "split": split, "trajectories": trajectories, "rounds": None,
                "tokens_per_round": None, "tokens_per_trajectory": None, "generated_tokens": None,
                "tool_rounds": None, "tool_seconds": None, "sandbox_seconds": None, "judge_calls": None,
                "source": None}
    rounds = c.rounds or 1.0
    return {"domain": domain, "split": split, "trajectories": trajectories, "rounds": rounds,
            "tokens_per_round": tpt / rounds, "tokens_per_trajectory": tpt,
            "generated_tokens": trajectories * rounds * (tpt / rounds),
            "tool_rounds": trajectories * c.tool_rounds, "tool_seconds": trajectories * c.tool_seconds,
            "sandbox_seconds": trajectories * c.sandbox_seconds, "judge_calls": trajectories * c.judge_calls,
            "source": c.source}


def estimate(counts: dict[str, Counts], train: dict[str, Cost], evals: dict[str, Cost],
             resample: dict[str, Cost] | None = None, rewarded: bool = False) -> dict[str, Any]:
    """Rows per domain and split and their totals: ``trajectories × rounds × tokens per round`` and the
    tool, sandbox and judge costs (:func:`_line`). Re-samples are costed with ``resample[d]`` (else the
    domain's train cost). ``rewarded``: tokens per trajectory of each split taken as its passing samples'
    mean (:attr:`Cost.pass_tokens`, where one is known), the far end of training's drift.

    Returns:
        ``{"rows": [...], "total": {...}, "by_split": {"train": {...}, "eval": {...}}}``.
    """
    resample = resample or {}
    rows = []

    def tpt(c: Cost | None) -> float | None:
        if c is None:
            return None
        return c.pass_tokens if rewarded and c.pass_tokens is not None else c.tokens

    for d, n in counts.items():
        tr = train.get(d)
        rs = resample.get(d) or tr
        row = _line(d, TRAIN, n.train_samples, tr, tpt(tr))
        extra = _line(d, TRAIN, n.resample_trajectories, rs, tpt(rs))
        row["resample_trajectories"] = n.resample_trajectories
        if row["generated_tokens"] is not None and extra["generated_tokens"] is not None:
            for k in ("generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls"):
                row[k] += extra[k]
            row["trajectories"] += n.resample_trajectories
            row["tokens_per_trajectory"] = row["generated_tokens"] / row["trajectories"] if row["trajectories"] else 0.0
            row["tokens_per_round"] = row["tokens_per_trajectory"] / row["rounds"]
        else:
            row["trajectories"] += n.resample_trajectories
        rows.append(row)
        if n.eval_trajectories:
            ev = evals.get(d)
            rows.append(_line(d, EVAL, n.eval_trajectories, ev, tpt(ev)))
    return {"rows": rows, "total": _sum(rows), "by_split": {s: _sum([r for r in rows if r["split"] == s])
                                                           for s in (TRAIN, EVAL)}}


def _sum(rows: list[dict]) -> dict[str, float | None]:
    """Totals of ``rows`` (``None`` where any row's value is unknown)."""
    out: dict[str, float | None] = {}
    for k in ("trajectories", "generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls"):
        vals = [r[k] for r in rows]
        out[k] = None if any(v is None for v in vals) else float(sum(vals))
    return out


def as_json(obj: Any) -> Any:
    """``obj`` with dataclasses as dicts (for ``--json``)."""
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, dict):
        return {k: as_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_json(v) for v in obj]
    return obj


def _costs(pilot: Pilot | None, hist: dict | None, domains: list[str],
           cfg=None) -> tuple[dict, dict, dict, list[str]]:
    """Train, eval and re-sample costs per domain: the history's (one run's per-split means, applied to
    every domain) where it has them, else the pilot's; and notes on what came from where (and on the
    settings that make the history's lengths another run's, when they differ from ``cfg``'s)."""
    notes: list[str] = []
    if hist and cfg is not None:
        then = hist.get("config") or {}
        for sec, key in (("model", "name"), ("scheduler", "max_tokens"), ("scheduler", "temperature")):
            was, now = (then.get(sec) or {}).get(key), getattr(getattr(cfg, sec), key)
            if was is not None and was != now:
                notes.append(f"the report's run had {sec}.{key}={was!r}, this config {now!r}: its lengths may not carry over")
    train = dict(pilot.train) if pilot else {}
    evals = dict(pilot.eval) if pilot else {}
    resample = dict(pilot.resample) if pilot else {}
    if hist:
        hc = hist["costs"]
        for d in domains:
            if TRAIN in hc:
                train[d] = hc[TRAIN]
                resample.pop(d, None)  # the run's mean already holds its re-samples
            if EVAL in hc:
                evals[d] = hc[EVAL]
            elif d not in evals and TRAIN in hc:
                evals[d] = replace(hc[TRAIN], source=hc[TRAIN].source + " (train mean; the report has no eval cost)")
        if EVAL not in hc:
            notes.append("the report has no 'cost' (made before the run report carried it): eval tokens from "
                         + ("the pilot" if pilot else "the trained samples' mean"))
    return train, evals, resample, notes


def budget_report(cfg, tasks: list[dict], pilot: Pilot | None = None, hist: dict | None = None,
                  config_name: str = "") -> dict[str, Any]:
    """The whole estimate of ``flywheel budget`` (its ``--json``), from the config, its tasks and the
    pilot's and/or a report's measurements.

    ``estimate`` is the primary figure: with a history, the history's per-trajectory costs and unsolved
    share as they are (they hold the run's learning); with the pilot only, the even-pace learning model
    (:func:`_pilot_estimates`), with ``range`` its two ends.

    Raises:
        ValueError: neither a pilot nor a history was given, or no domain can take training groups.
    """
    if pilot is None and hist is None:
        raise ValueError("nothing to take the tokens per trajectory from: run the pilot or give --history")
    unsolved = dict(pilot.unsolved) if pilot else {}
    if hist and hist.get("unsolved") is not None:
        unsolved = {d: hist["unsolved"] for d in {t["domain"] for t in tasks}}
    counts = plan_counts(cfg, tasks, unsolved)
    train, evals, resample, notes = _costs(pilot, hist, list(counts), cfg)
    out: dict[str, Any] = {"config": config_name, "plan": _plan(cfg, tasks), "notes": notes + (pilot.notes if pilot else [])}
    if hist:
        out["estimate"], out["method"] = estimate(counts, train, evals, resample), f"history ({hist['source']})"
    else:
        out["estimate"], v0, learned, out["learning"], counts = _pilot_estimates(cfg, tasks, pilot, counts)
        out["method"] = "pilot, even-pace learning"
        out["range"] = {"no_learning": v0["total"], "learned": learned["total"]}
    out["counts"] = {d: dict(asdict(c), train_samples=c.train_samples, resample_trajectories=c.resample_trajectories,
                             eval_trajectories=c.eval_trajectories) for d, c in counts.items()}
    if pilot:
        out["pilot"] = as_json(pilot)
    if hist:
        out["history"] = {"source": hist["source"], "unsolved": hist.get("unsolved"), "totals": hist.get("totals"),
                          "path": hist.get("path")}
    return out


def _pilot_estimates(cfg, tasks: list[dict], pilot: Pilot, counts: dict[str, Counts]):
    """The pilot's estimate under even-pace learning, and its two ends (see :mod:`flywheel.budget`).

    A run's progress t goes from 0 (the version-0 policy the pilot measured) to 1 (the rewarded policy: every
    trajectory as long as the pilot's passing training samples, :attr:`Cost.pass_tokens`) at an even pace
    over its versions: each length L(t) = L₀ + (L* − L₀)·t (L* of a greedy eval: :attr:`Pilot.greedy_tokens`),
    and the pass rate of a task the pilot saw pass, in its group or its re-sample, p(t) = p₀ + (1 − p₀)·t. A
    training group (issued evenly over the run) is then at t = ½ on average and an eval round at version v at
    t = v / max_steps. A task the pilot never saw pass gives GRPO nothing to learn from (all its rewards equal:
    every advantage 0), so it stays unsolved; the others' unsolved share over the run is
    ∫(1 − p(t))^K dt = (1 − p₀)^K / (K + 1), re-sampled early (at t = 1 / (K + 2) on average, for p₀ near 0),
    while the never-solved ones are re-sampled evenly over the run (t = ½).

    Returns:
        ``(even_pace, no_learning, learned, progress, counts)``: three :func:`estimate` results, the t of
        each kind of trajectory with the unsolved share over the run, and the even-pace :class:`Counts`.
    """
    b, sc = cfg.budget, cfg.scheduler
    versions = eval_round_versions(b.max_steps, sc.eval_every, sc.eval_before_training, True)
    t_eval = sum(versions) / len(versions) / b.max_steps
    target = {d: c.pass_tokens for d, c in pilot.train.items() if c.pass_tokens is not None}
    greedy = {**target, **{d: g for d, g in pilot.greedy_tokens.items() if g is not None}}
    no_learning = estimate(counts, pilot.train, pilot.eval, pilot.resample)
    learned = estimate(plan_counts(cfg, tasks, {d: 0.0 for d in counts}), _toward(pilot.train, target, 1.0),
                       _toward(pilot.eval, greedy, 1.0), _toward(pilot.resample, target, 1.0))
    run_u: dict[str, float | None] = {}
    t_re: dict[str, float] = {}
    for d, u in pilot.unsolved.items():
        k, never = counts[d].samples_per_task if d in counts else cfg.tasks.samples_per_task, pilot.never_solved.get(d)
        if u is None or never is None:
            run_u[d] = None
            continue
        run_u[d] = never + (u - never) / (k + 1)
        t_re[d] = (never * 0.5 + (run_u[d] - never) / (k + 2)) / run_u[d] if run_u[d] else 0.0
    even = estimate(plan_counts(cfg, tasks, run_u), _toward(pilot.train, target, 0.5),
                    _toward(pilot.eval, greedy, t_eval), _toward(pilot.resample, target, t_re))
    progress = {"train": 0.5, "eval": t_eval, "resample": t_re, "unsolved_over_run": run_u,
                "rewarded_tokens": target, "rewarded_greedy_tokens": greedy}
    return even, no_learning, learned, progress, plan_counts(cfg, tasks, run_u)


def _toward(costs: dict[str, Cost], target: dict[str, float], t: float | dict[str, float]) -> dict[str, Cost]:
    """``costs`` with each domain's tokens per trajectory moved a share ``t`` (a number, or one per domain) of
    the way to ``target[d]``; domains without a target are unchanged. Rounds, tools and judge calls are kept."""
    out = {}
    for d, c in costs.items():
        td = t.get(d, 0.0) if isinstance(t, dict) else t
        out[d] = replace(c, tokens=c.tokens + (target[d] - c.tokens) * td) if d in target else c
    return out


def _plan(cfg, tasks: list[dict]) -> dict[str, Any]:
    b, sc = cfg.budget, cfg.scheduler
    has_eval = any(t.get("split") == EVAL for t in tasks)
    return {"max_steps": b.max_steps, "groups_per_step": math.ceil(b.batch_groups * b.oversample),
            "training_groups": issued_training_groups(b.batch_groups, b.oversample, b.max_steps),
            "resample_unsolved": b.resample_unsolved, "max_tokens": sc.max_tokens, "temperature": sc.temperature,
            "eval_round_versions": eval_round_versions(b.max_steps, sc.eval_every, sc.eval_before_training, has_eval)}
