"""The pilot of ``flywheel budget``: a few training and held-out tasks generated with the config's model and
rollout engine and scored in-process by the verifier's scorer (:func:`run_pilot`), summarised per domain
into a :class:`Pilot` (costs, unsolved shares, the rewarded policy's greedy length); also the tasks a run
submits (:func:`all_tasks`)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from flywheel.budget.costs import Cost, mean_cost
from flywheel.budget.trajectories import EVAL, TRAIN, unsolved_probability


@dataclass
class Pilot:
    """What the pilot measured, per domain: train and eval :class:`Cost`, the re-samples' cost (the training
    samples weighted by their task's chance to come back unsolved) and the unsolved share."""

    train: dict[str, Cost] = field(default_factory=dict)
    eval: dict[str, Cost] = field(default_factory=dict)
    resample: dict[str, Cost] = field(default_factory=dict)
    unsolved: dict[str, float | None] = field(default_factory=dict)
    """Estimated ``(1 − p)^K`` over the pilot's training tasks (:func:`unsolved_probability`), per domain."""
    never_solved: dict[str, float | None] = field(default_factory=dict)
    """Share of the pilot's training tasks without a single passing sample, their re-sample's included."""
    greedy_tokens: dict[str, float | None] = field(default_factory=dict)
    """The rewarded policy's greedy answer length per domain (:func:`greedy_target`)."""
    seconds: float = 0.0
    """Wall seconds of the pilot, model load included."""
    load_seconds: float = 0.0
    tasks: dict[str, int] = field(default_factory=dict)
    """Pilot tasks per split."""
    samples_per_task: int = 0
    notes: list[str] = field(default_factory=list)


def all_tasks(cfg, pilot_n: int = 16) -> list[dict]:
    """What a ``flywheel run`` of ``cfg`` submits (:func:`flywheel.tasks.make_tasks`), plus ``pilot_n``
    training and the held-out tasks of each generator domain (:func:`generator_tasks`).

    Raises:
        ValueError: the task source cannot make its tasks.
    """
    from flywheel.tasks import make_tasks

    return make_tasks(cfg.tasks) + generator_tasks(cfg, pilot_n, seed=cfg.scheduler.seed)


def generator_tasks(cfg, n: int, seed: int = 0) -> list[dict]:
    """Task bodies of the scheduler's generator domains (``domains.<d>.generator``): ``n`` training tasks at
    the current level (for the pilot: the scheduler makes the real ones) and the ``eval_size`` held-out ones
    at ``eval_level`` (counted in the plan), each tagged with its domain.

    Raises:
        ImportError, AttributeError: the generator cannot be imported.
    """
    import importlib

    out: list[dict] = []
    for d, dc in (getattr(cfg, "domains", {}) or {}).items():
        gen = getattr(dc, "generator", None)
        if not gen:
            continue
        mod, _, fn = gen.partition(":")
        make = getattr(importlib.import_module(mod), fn or "make")
        for split, count, level in ((TRAIN, n, dc.level), (EVAL, dc.eval_size, dc.eval_level)):
            if count:
                out += [{**t, "domain": d, "split": split}
                        for t in make(count, seed=seed, split=split, **dc.level_params(level))]
    return out


def pick_pilot_tasks(tasks: list[dict], n: int, seed: int = 0) -> dict[str, list[dict]]:
    """Up to ``n`` tasks per split, drawn round-robin over the domains (every domain at least once while
    ``n`` allows), each domain's in a seeded random order."""
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {}
    for split in (TRAIN, EVAL):
        by_domain: dict[str, list[dict]] = {}
        for t in tasks:
            if t.get("split", TRAIN) == split:
                by_domain.setdefault(t["domain"], []).append(t)
        for lst in by_domain.values():
            rng.shuffle(lst)
        picked: list[dict] = []
        queues = [by_domain[d] for d in sorted(by_domain)]
        while len(picked) < n and any(queues):
            for q in queues:
                if q and len(picked) < n:
                    picked.append(q.pop())
        out[split] = picked
    return out


def run_pilot(cfg, tasks: list[dict], n_tasks: int = 16, samples: int | None = None, seed: int = 0) -> Pilot:
    """Generate and score a few tasks with the config's model and rollout engine, in process.

    ``n_tasks`` training tasks with ``samples`` samples each (default: the task's K) at
    ``scheduler.temperature``, and ``n_tasks`` held-out tasks greedily (one sample), each with its
    domain's ``max_tokens`` (else ``scheduler.max_tokens``); tool tasks run the rollout's tool loop
    against ``rollout.sandbox_url``. Scored by the verifier's :class:`verifier_service.scorers.Scorer`
    with the judge layer left out (judge calls are counted, not made).

    Raises:
        FileNotFoundError: the model is neither the SmolLM2 alias nor a model directory.
        TimeoutError: an SGLang engine is not ready (``rollout.engine: sglang``).
    """
    from rollout_service.main import build_engine

    t0 = time.perf_counter()
    engine, tok = build_engine(cfg)
    pilot = Pilot(load_seconds=time.perf_counter() - t0)
    picked = pick_pilot_tasks(tasks, n_tasks, seed)
    pilot.tasks = {s: len(v) for s, v in picked.items()}
    try:
        rows = asyncio.run(_pilot_rows(cfg, engine, tok, picked, samples, pilot.notes))
    finally:
        engine.close()
    _summarise(pilot, rows, cfg, samples)
    pilot.seconds = time.perf_counter() - t0
    return pilot


async def _pilot_rows(cfg, engine, tok, picked: dict[str, list[dict]], samples: int | None,
                      notes: list[str]) -> list[dict]:
    """Generate every picked task (plain ones batched like the rollout service, tool ones through the tool
    loop), then score each trajectory; one row per trajectory (see :func:`mean_cost`), with ``domain``,
    ``split`` and ``task_id``."""
    from rollout_service.tool_loop import ToolRunner
    from verifier_service.scorers import Scorer

    groups = [_request(cfg, t, split, samples) for split, ts in picked.items() for t in ts]
    runner = ToolRunner(cfg.rollout.sandbox_url, cfg.rollout.tool_timeout_s)
    scorer = Scorer(cfg.verifier)
    try:
        rows = await _generate_and_score(cfg, engine, tok, runner, scorer, groups, notes)
        again = _resample_requests(cfg, groups, rows)
        if again:  # as the run does: one group of budget.resample_unsolved samples per unsolved group
            rows += [dict(r, resample=True)
                     for r in await _generate_and_score(cfg, engine, tok, runner, scorer, again, notes)]
    finally:
        await runner.close()
        await scorer.close()
    return rows


async def _generate_and_score(cfg, engine, tok, runner, scorer, groups, notes: list[str]) -> list[dict]:
    """Rows of ``groups`` (rollout requests): generated, then scored one by one."""
    rows = []
    for req, trajs in zip(groups, await _generate(cfg, engine, tok, runner, groups)):
        for traj in trajs:
            rows.append(dict(await _score(scorer, req, traj, notes), text=traj["text"], logprob=traj["logprob"]))
    return rows


def _resample_requests(cfg, groups, rows: list[dict]) -> list:
    """The re-samples the run would send for the pilot's training ``groups`` whose scored samples (``rows``)
    all failed: ``budget.resample_unsolved`` samples of the task, when that is more than the group's."""
    n = cfg.budget.resample_unsolved
    out = []
    for g in groups:
        mine = [r for r in rows if r["task_id"] == g.task.task_id and r["split"] == TRAIN]
        if g.purpose == TRAIN and n > g.n and mine and not any(r["passed"] or r["passed"] is None for r in mine):
            out.append(g.model_copy(update={"group_id": g.group_id + ":resample", "n": n}))
    return out


def _request(cfg, task: dict, split: str, samples: int | None):
    """The ``RolloutRequest`` the scheduler would send for ``task`` (eval: greedy, one sample)."""
    from shared.schemas import RolloutRequest, SamplingParams, Task

    body = {k: v for k, v in task.items() if k in Task.model_fields}
    t = Task(**body)
    dc = (getattr(cfg, "domains", {}) or {}).get(t.domain)
    max_tokens = getattr(dc, "max_tokens", None) or cfg.scheduler.max_tokens
    greedy = split == EVAL
    n = 1 if greedy else int(samples or t.samples_per_task)
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0 if greedy else cfg.scheduler.temperature)
    return RolloutRequest(group_id=f"pilot-{t.task_id}", task=t, n=n, sampling=sampling, purpose=split)


async def _generate(cfg, engine, tok, runner, groups) -> list[list[dict]]:
    """Trajectories per request: ``{text, tokens, rounds, tool_rounds, tool_seconds, finish_reason, logprob}``
    (``logprob``: the completion's log-probability under the sampling policy, natural log)."""
    from rollout_service.engine import GenerationRequest
    from rollout_service.generation import prompt_messages, uses_tools
    from rollout_service.tool_loop import run_tool_loop
    from shared.model import encode_chat

    out: list[list[dict] | None] = [None] * len(groups)
    plain = []
    for i, r in enumerate(groups):
        prompt = encode_chat(tok, prompt_messages(r, cfg.model.system_prompt))
        if uses_tools(r):
            ros = await run_tool_loop(engine, tok, runner, r.task, prompt, r.n, r.sampling,
                                      cfg.rollout.max_trajectory_tokens)
            out[i] = [{"text": tok.decode(ro.ids, skip_special_tokens=True),  # as emitted: tool turns included
                       "tokens": ro.generated_tokens, "rounds": sum(x["role"] == "assistant" for x in ro.turns),
                       "tool_rounds": ro.tool_rounds, "tool_seconds": ro.tool_seconds,
                       "finish_reason": ro.finish_reason, "logprob": sum(ro.logprobs)} for ro in ros]
        else:
            plain.append((i, GenerationRequest(prompt, r.n, r.sampling)))
    cap = cfg.rollout.max_batch_samples
    batch: list[tuple[int, Any]] = []
    for j, item in enumerate(plain):
        batch.append(item)
        if j == len(plain) - 1 or sum(g.n for _, g in batch) + plain[j + 1][1].n > cap:
            res = await asyncio.to_thread(engine.generate, [g for _, g in batch])
            for (i, _), samples in zip(batch, res):
                out[i] = [{"text": tok.decode(s.completion_ids, skip_special_tokens=True),
                           "tokens": len(s.completion_ids), "rounds": 1, "tool_rounds": 0, "tool_seconds": 0.0,
                           "finish_reason": s.finish_reason, "logprob": sum(s.logprobs)} for s in samples]
            batch = []
    return out  # type: ignore[return-value]


async def _score(scorer, req, traj: dict, notes: list[str]) -> dict:
    """One pilot row: ``traj`` scored under its task's recipe without the judge layer (a judge call is
    counted when the recipe has a judge and no gate or hack zeroed the reward first)."""
    from shared.schemas import UnitTestsSpec

    t = req.task
    spec = t.verifier
    recipe = scorer.recipe_for(spec, t.domain)
    judged = recipe.judge is not None
    if judged:
        weights = {k: w for k, w in recipe.weights.items() if k != "judge"} or {"correctness": 1.0}
        spec = spec.model_copy(update={"recipe": recipe.model_copy(update={"judge": None, "weights": weights})})
    t0 = time.perf_counter()
    reward = await scorer.score(spec, traj["text"], finish_reason=traj["finish_reason"],
                                prompt=[m.model_dump() for m in t.prompt], tools=t.tools, domain=t.domain)
    seconds = time.perf_counter() - t0
    if reward.infra_error:
        note = f"{t.domain}: could not score a pilot sample ({reward.details.get('reason')}); pass rate left out"
        if note not in notes:
            notes.append(note)
    zeroed = bool(reward.details.get("gated_by") or reward.details.get("zeroed_by"))
    return {"domain": t.domain, "split": req.purpose, "task_id": t.task_id, "tokens": traj["tokens"],
            "rounds": traj["rounds"], "tool_rounds": traj["tool_rounds"], "tool_seconds": traj["tool_seconds"],
            "sandbox_seconds": seconds if isinstance(spec, UnitTestsSpec) else 0.0,
            "judge_calls": float(judged and not zeroed), "truncated": traj["finish_reason"] == "length",
            "passed": None if reward.infra_error else bool(reward.passed)}


def _summarise(pilot: Pilot, rows: list[dict], cfg, samples: int | None) -> None:
    """Fill ``pilot``'s per-domain costs, unsolved shares and greedy target lengths from the pilot ``rows``
    (re-sample rows, ``resample: True``, cost the re-samples and tell a task never solved)."""
    pilot.samples_per_task = int(samples or cfg.tasks.samples_per_task)
    k_of = {r["domain"]: cfg.tasks.samples_per_task for r in rows}
    for d, dc in (getattr(cfg, "domains", {}) or {}).items():
        if getattr(dc, "samples_per_task", None):
            k_of[d] = dc.samples_per_task
    for d in sorted({r["domain"] for r in rows}):
        mine = [r for r in rows if r["domain"] == d]
        first = [r for r in mine if not r.get("resample")]
        for split, into in ((TRAIN, pilot.train), (EVAL, pilot.eval)):
            c = mean_cost([r for r in first if r["split"] == split])
            if c is not None:
                into[d] = c
        by_task: dict[str, list[dict]] = {}
        for r in first:
            if r["split"] == TRAIN and r["passed"] is not None:
                by_task.setdefault(r["task_id"], []).append(r)
        if not by_task:
            pilot.unsolved[d] = pilot.never_solved[d] = None
            continue
        u = {tid: unsolved_probability(sum(r["passed"] for r in rs), len(rs), k_of[d]) for tid, rs in by_task.items()}
        pilot.unsolved[d] = sum(u.values()) / len(u)
        again = [r for r in mine if r.get("resample")]
        solved = {r["task_id"] for r in first + again if r["passed"]}
        pilot.never_solved[d] = sum(tid not in solved for tid in by_task) / len(by_task)
        # the re-samples as generated; without any, the samples weighted by their task's chance to need one
        rc = (mean_cost(again, "pilot re-samples") if again else
              mean_cost([dict(r, w=u[tid]) for tid, rs in by_task.items() for r in rs], "pilot (unsolved-weighted)"))
        if rc is not None:
            pilot.resample[d] = rc
        pilot.greedy_tokens[d] = greedy_target([r for r in first if r["split"] == TRAIN])


def greedy_target(rows: list[dict]) -> float | None:
    """Generated tokens of the rewarded policy's greedy answer, estimated from sampled ``rows`` (with
    ``task_id``, ``tokens``, ``passed`` and ``logprob``, the completion's log-probability): greedy decoding
    returns (nearly) the most probable sequence, and the rewarded policy's most probable sequence is the base
    policy's most probable passing one; so per task the length of the passing sample with the highest
    log-probability, averaged over the tasks with a pass. ``None`` when none passed."""
    best: dict[str, tuple[float, int]] = {}
    for r in rows:
        if r.get("passed"):
            lp = float(r.get("logprob", 0.0))
            if r["task_id"] not in best or lp > best[r["task_id"]][0]:
                best[r["task_id"]] = (lp, r["tokens"])
    return sum(t for _, t in best.values()) / len(best) if best else None
