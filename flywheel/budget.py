"""``flywheel budget``: what a run will generate, estimated before it starts.

The estimate is the seeds' formula, per domain and split (train / eval)::

    generated tokens = trajectories × rounds per trajectory × generated tokens per round

plus tool rounds, tool seconds, sandbox seconds (unit tests in the verifier) and judge calls where the
domain's tasks use them (each a per-trajectory mean times the trajectories).

*Trajectories* come from the config alone (:func:`plan_counts`):

- training: ``max_steps × ⌈batch_groups × oversample⌉`` groups (the sampler's issue budget,
  :func:`scheduler_service.sampler.training_budget` summed over the run) × ``samples_per_task``, shared
  between domains by their ``domains.<d>.weight`` (default 1, paused or retired domains 0), plus the
  expected re-samples: each group that comes back unsolved (no sample passed) is followed by one group
  of ``budget.resample_unsolved`` samples when that is larger than K (:func:`shared.groups.resample_wanted`);
  the unsolved fraction is the mean over tasks of ``(1 − p)^K`` (:func:`unsolved_probability`);
- evaluation: held-out tasks × eval rounds (:func:`eval_round_versions`: round 0 when
  ``eval_before_training``, one per ``eval_every`` multiple up to ``max_steps``, and the final round
  ``flywheel run`` creates at ``max_steps`` when none falls there).

*Per-trajectory costs* come from a short pilot (:func:`run_pilot`: the config's model with the rollout's
engine settings, K samples of a few training tasks at the config's temperature and ``max_tokens``, one
greedy sample of a few held-out tasks, scored in-process by the verifier's :class:`Scorer`), or from a
finished run's report (:func:`history_costs`, ``flywheel run --report``).

The pilot measures the policy at version 0, and training moves it: a task whose reward favours short
answers gets shorter completions (longer ones the other way round), held-out greedy lengths follow, and
the tasks the policy learns need no more re-samples. With the pilot alone the estimate assumes *even-pace
learning* (:func:`_pilot_estimates`) towards the rewarded policy, the one that answers like the pilot's
passing samples (the optimum of a 0/1 reward under a KL penalty β, π* ∝ π₀·exp(r/β), is nearly π₀
conditioned on passing for β ≪ 1): sampled lengths move at an even pace from the version-0 mean to the
passing samples' mean (:attr:`Cost.pass_tokens`) and greedy ones to the length of the most probable
passing answer (:func:`greedy_target`: greedy decoding returns the most probable sequence), each kind of
trajectory costed at its mean progress through the run (training groups ½, an eval round at version v at
v / max_steps). The pilot re-samples its unsolved groups as the run does; a task that passes in neither
group stays unsolved over the run (an all-fail group has zero advantage, so nothing in the run teaches
it), the others are learned at the same even pace (unsolved share over the run (1 − p₀)^K / (K + 1)).
``range`` gives the two ends: ``no_learning`` (the version-0 policy throughout, an upper bound where
lengths shrink) and ``learned`` (the rewarded policy from the start, no re-samples). A finished run's
report (``--history``) replaces the model with what that run measured.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

TRAIN, EVAL = "train", "eval"
COST_KEYS = ("samples", "generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls")
"""Keys of ``GET /v1/status`` ``cost.<split>`` (and so of a report's ``cost``): what a run actually spent."""


# ---------------------------------------------------------------- trajectories (the config alone)


def issued_training_groups(batch_groups: int, oversample: float, max_steps: int) -> int:
    """Training groups the sampler issues over a run: ``max_steps × ⌈batch_groups × oversample⌉`` (the
    total cap of :func:`scheduler_service.sampler.training_budget` at the last version; re-samples of
    unsolved groups and replacements of dropped ones come on top)."""
    return max_steps * math.ceil(batch_groups * oversample)


def eval_round_versions(max_steps: int, eval_every: int, eval_before_training: bool, has_eval: bool) -> list[int]:
    """Policy versions of the held-out rounds of a ``flywheel run``: 0 when ``eval_before_training``,
    every multiple of ``eval_every`` in ``(0, max_steps]`` (``scheduler.eval_every``; 0 = none), and
    ``max_steps`` (the final round of ``flywheel run``) unless one is there already. Empty without eval tasks."""
    if not has_eval:
        return []
    out = [0] if eval_before_training else []
    if eval_every > 0:
        out += list(range(eval_every, max_steps + 1, eval_every))
    if max_steps not in out:
        out.append(max_steps)
    return out


def unsolved_probability(passes: int, samples: int, k: int) -> float:
    """Estimate of ``(1 − p)^k``, the chance that a group of ``k`` samples of a task with pass rate ``p``
    has no pass, from ``passes`` of ``samples`` pilot samples of the task.

    With ``samples ≥ k`` it is the unbiased ``C(samples − passes, k) / C(samples, k)`` (the share of
    ``k``-subsets of the pilot samples without a pass; the plug-in ``(1 − passes/samples)^k`` would
    overstate it, by Jensen's inequality); with fewer samples, the plug-in.

    Raises:
        ValueError: ``samples < 1``, ``k < 1`` or ``passes`` outside ``[0, samples]``.
    """
    if samples < 1 or k < 1 or not 0 <= passes <= samples:
        raise ValueError(f"need 0 <= passes <= samples, samples >= 1, k >= 1 (got {passes}, {samples}, {k})")
    if samples >= k:
        return math.comb(samples - passes, k) / math.comb(samples, k)
    return (1.0 - passes / samples) ** k


@dataclass
class Counts:
    """Trajectories of one domain over a run, by origin (group counts are expected values: fractional)."""

    train_groups: float
    """Issued training groups (the domain's share of :func:`issued_training_groups`)."""
    samples_per_task: int
    """K of its training groups."""
    resample_groups: float = 0.0
    """Expected re-samples of unsolved groups: ``train_groups × unsolved``."""
    resample_samples: int = 0
    """Samples of one re-sample (``budget.resample_unsolved``; 0 when re-sampling is off or not larger than K)."""
    unsolved: float | None = None
    """Expected share of training groups that come back unsolved (``None``: not known)."""
    eval_tasks: int = 0
    eval_rounds: int = 0

    @property
    def train_samples(self) -> float:
        """Trajectories of the issued groups (re-samples not included)."""
        return self.train_groups * self.samples_per_task

    @property
    def resample_trajectories(self) -> float:
        return self.resample_groups * self.resample_samples

    @property
    def eval_trajectories(self) -> int:
        """Greedy held-out trajectories: one per eval task and round."""
        return self.eval_tasks * self.eval_rounds


def domain_shares(domains: list[str], configured: dict[str, Any]) -> dict[str, float]:
    """Share of the training groups per domain: its weight over the sum (``configured`` are the
    scheduler's ``domains`` entries; an unconfigured domain has weight 1, a paused or retired one 0).

    Raises:
        ValueError: every domain has weight 0.
    """
    weights = {}
    for d in domains:
        dc = configured.get(d)
        state = getattr(dc, "state", "active")
        weights[d] = 0.0 if state != "active" else float(getattr(dc, "weight", 1.0))
    total = sum(weights.values())
    if domains and total <= 0:
        raise ValueError(f"every training domain has weight 0 or is paused: {sorted(domains)}")
    return {d: w / total for d, w in weights.items()} if total else {}


def plan_counts(cfg, tasks: list[dict], unsolved: dict[str, float | None] | None = None) -> dict[str, Counts]:
    """Trajectories per domain of a ``flywheel run`` of ``cfg`` (a ``FlywheelConfig``) submitting ``tasks``
    (task bodies, as :func:`flywheel.tasks.make_tasks`), with ``unsolved[d]`` the expected share of the
    domain's training groups that come back unsolved (missing or ``None``: no re-samples counted).

    Raises:
        ValueError: no domain can take training groups.
    """
    b, sc = cfg.budget, cfg.scheduler
    unsolved = unsolved or {}
    configured = dict(getattr(cfg, "domains", {}) or {})
    train_k: dict[str, int] = {}
    eval_n: dict[str, int] = {}
    for t in tasks:
        d = t["domain"]
        if t.get("split", TRAIN) == EVAL:
            eval_n[d] = eval_n.get(d, 0) + 1
        else:
            train_k.setdefault(d, int(t.get("samples_per_task", cfg.tasks.samples_per_task)))
    for d, dc in configured.items():  # generator domains make their training tasks in the scheduler
        if getattr(dc, "generator", None):
            train_k.setdefault(d, cfg.tasks.samples_per_task)
    for d, dc in configured.items():
        if d in train_k and getattr(dc, "samples_per_task", None):
            train_k[d] = int(dc.samples_per_task)
    groups = issued_training_groups(b.batch_groups, b.oversample, b.max_steps)
    shares = domain_shares(sorted(train_k), configured)
    rounds = len(eval_round_versions(b.max_steps, sc.eval_every, sc.eval_before_training, sum(eval_n.values()) > 0))
    out: dict[str, Counts] = {}
    for d in sorted(set(train_k) | set(eval_n)):
        k = train_k.get(d, cfg.tasks.samples_per_task)
        u = unsolved.get(d)
        n_re = b.resample_unsolved if b.resample_unsolved > k else 0
        g = groups * shares.get(d, 0.0)
        out[d] = Counts(train_groups=g, samples_per_task=k, resample_groups=g * (u or 0.0) if n_re else 0.0,
                        resample_samples=n_re, unsolved=u, eval_tasks=eval_n.get(d, 0),
                        eval_rounds=rounds if eval_n.get(d) else 0)
    return out


# ---------------------------------------------------------------- per-trajectory costs


@dataclass
class Cost:
    """What one trajectory of a domain and split costs, on average over ``n`` measured trajectories."""

    tokens: float
    """Generated tokens (tool output excluded)."""
    rounds: float = 1.0
    """Assistant turns (generation rounds) per trajectory."""
    tool_rounds: float = 0.0
    tool_seconds: float = 0.0
    """Seconds of tool calls in the sandbox (the rollout's tool loop)."""
    sandbox_seconds: float = 0.0
    """Seconds of the verifier's unit tests in the sandbox."""
    judge_calls: float = 0.0
    n: int = 0
    truncated: float | None = None
    """Share of trajectories cut off at the token budget (finish_reason ``length``)."""
    pass_rate: float | None = None
    pass_tokens: float | None = None
    """Mean generated tokens of the passing trajectories (``None``: none passed)."""
    source: str = "pilot"

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


def mean_cost(rows: list[dict], source: str = "pilot") -> Cost | None:
    """The :class:`Cost` of measured trajectories, each a dict with ``tokens``, ``rounds``, ``tool_rounds``,
    ``tool_seconds``, ``sandbox_seconds``, ``judge_calls``, ``truncated``, ``passed`` (``None`` when it
    could not be scored) and optionally a weight ``w`` (default 1); ``None`` for no rows or no weight."""
    wsum = sum(float(r.get("w", 1.0)) for r in rows)
    if not rows or wsum <= 0:
        return None

    def avg(key: str, among: list[dict] = rows) -> float:
        total = sum(float(r.get("w", 1.0)) for r in among)
        return sum(float(r.get("w", 1.0)) * float(r.get(key) or 0.0) for r in among) / total

    scored = [r for r in rows if r.get("passed") is not None and r.get("w", 1.0) > 0]
    passing = [r for r in scored if r["passed"]]
    return Cost(tokens=avg("tokens"), rounds=avg("rounds"), tool_rounds=avg("tool_rounds"),
                tool_seconds=avg("tool_seconds"), sandbox_seconds=avg("sandbox_seconds"),
                judge_calls=avg("judge_calls"), n=len(rows), truncated=avg("truncated"),
                pass_rate=avg("passed", scored) if scored else None,
                pass_tokens=avg("tokens", passing) if passing else None, source=source)


def history_costs(path: str | Path) -> dict[str, Any]:
    """Per-trajectory costs of a finished run, from its report JSON (``flywheel run --report``).

    Uses the report's ``cost`` (``GET /v1/status`` ``cost``, what the run actually generated, per split)
    when present; else the trainer's per-step history (``train/response_len`` × ``train/samples``: the
    trained samples only, no eval), so the eval split is then unknown. Also the observed unsolved share
    (``train/superseded_unsolved_total`` over the issued groups) when the history has it.

    Returns:
        ``{"costs": {split: Cost}, "unsolved": float | None, "source": str, "totals": {split: {...}},
        "config": the run's config}``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a report (not JSON, or neither ``cost`` nor a history with response lengths).
    """
    try:
        rep = orjson.loads(Path(path).read_bytes())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(rep, dict):
        raise ValueError(f"{path}: not a flywheel run report (top level is not an object)")
    costs: dict[str, Cost] = {}
    totals: dict[str, dict] = {}
    for split, c in (rep.get("cost") or {}).items():
        if isinstance(c, dict) and c.get("samples"):
            n = float(c["samples"])
            totals[split] = {k: c.get(k, 0) for k in COST_KEYS}
            costs[split] = Cost(tokens=float(c.get("generated_tokens", 0)) / n,
                                rounds=1.0 + float(c.get("tool_rounds", 0)) / n,
                                tool_rounds=float(c.get("tool_rounds", 0)) / n,
                                tool_seconds=float(c.get("tool_seconds", 0)) / n,
                                sandbox_seconds=float(c.get("sandbox_seconds", 0)) / n,
                                judge_calls=float(c.get("judge_calls", 0)) / n, n=int(n), source="history:cost")
    hist = [h for h in rep.get("history") or [] if h.get("train/response_len") is not None and h.get("train/samples")]
    if TRAIN not in costs and hist:
        n = sum(h["train/samples"] for h in hist)
        costs[TRAIN] = Cost(tokens=sum(h["train/response_len"] * h["train/samples"] for h in hist) / n, n=int(n),
                            truncated=sum(h.get("train/truncated_frac", 0.0) * h["train/samples"] for h in hist) / n,
                            source="history:train_steps")
    if not costs:
        raise ValueError(f"{path}: a report with neither 'cost' nor a history of train/response_len")
    return {"costs": costs, "unsolved": _history_unsolved(rep), "source": "+".join(sorted({c.source for c in costs.values()})),
            "totals": totals, "config": rep.get("config") or {}}


def _history_unsolved(rep: dict) -> float | None:
    """Share of issued training groups the trainer set aside as unsolved in the run of report ``rep``."""
    hist = rep.get("history") or []
    last = max((h.get("train/superseded_unsolved_total") or 0.0 for h in hist), default=None)
    b = (rep.get("config") or {}).get("budget") or {}
    if last is None or not b.get("max_steps"):
        return None
    return float(last) / issued_training_groups(b.get("batch_groups", 4), b.get("oversample", 1.0), b["max_steps"])


# ---------------------------------------------------------------- the pilot


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


# ---------------------------------------------------------------- the estimate


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


# ---------------------------------------------------------------- the command


def all_tasks(cfg, pilot_n: int = 16) -> list[dict]:
    """What a ``flywheel run`` of ``cfg`` submits (:func:`flywheel.tasks.make_tasks`), plus ``pilot_n``
    training and the held-out tasks of each generator domain (:func:`generator_tasks`).

    Raises:
        ValueError: the task source cannot make its tasks.
    """
    from flywheel.tasks import make_tasks

    return make_tasks(cfg.tasks) + generator_tasks(cfg, pilot_n, seed=cfg.scheduler.seed)


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
    """The pilot's estimate under even-pace learning, and its two ends (module docstring).

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


def _r(d: dict) -> dict:
    """``d`` with its numbers rounded to 3 places (for printing)."""
    return {k: None if v is None else round(v, 3) for k, v in d.items()}


def render(report: dict, console) -> None:
    """Print ``report`` (:func:`budget_report`) as a rich table, with its source and the range."""
    from rich.console import Console
    from rich.table import Table

    def f(v, nd=0):
        return "-" if v is None else f"{v:,.{nd}f}"

    t = Table(title=f"flywheel budget {report.get('config', '')}: {report['method']}")
    for col in ("domain", "split", "trajectories", "re-samples", "rounds", "tokens/round", "tokens/traj",
                "generated tokens", "tool rounds", "sandbox s", "judge calls"):
        t.add_column(col, justify="left" if col in ("domain", "split") else "right", no_wrap=True)
    for r in report["estimate"]["rows"]:
        t.add_row(r["domain"], r["split"], f(r["trajectories"]), f(r.get("resample_trajectories")),
                  f(r["rounds"], 2), f(r["tokens_per_round"], 1), f(r["tokens_per_trajectory"], 1),
                  f(r["generated_tokens"]), f(r["tool_rounds"]), f(r["sandbox_seconds"], 1), f(r["judge_calls"]))
    for name, tot in (("train", report["estimate"]["by_split"][TRAIN]), ("eval", report["estimate"]["by_split"][EVAL]),
                      ("total", report["estimate"]["total"])):
        t.add_row(f"[bold]{name}", "", f(tot["trajectories"]), "", "", "", "", f"[bold]{f(tot['generated_tokens'])}",
                  f(tot["tool_rounds"]), f(tot["sandbox_seconds"], 1), f(tot["judge_calls"]))
    # every column in full, also when not on a terminal (80 columns then)
    Console(file=console.file, width=max(console.width, 160), force_terminal=console.is_terminal,
            no_color=console.no_color, soft_wrap=False).print(t)
    p = report["plan"]
    console.print(f"plan: {p['training_groups']} training groups ({p['max_steps']} steps x {p['groups_per_step']}), "
                  f"eval rounds at versions {p['eval_round_versions']}, re-samples of {p['resample_unsolved']}")
    if "range" in report:
        rg = report["range"]
        console.print(f"range: {f(rg['learned']['generated_tokens'])} generated tokens if the policy were the rewarded "
                      f"one from the start .. {f(rg['no_learning']['generated_tokens'])} if it stayed at version 0")
    if report.get("pilot"):
        pl = report["pilot"]
        console.print(f"pilot: {pl['tasks']} tasks, K={pl['samples_per_task']}, {pl['seconds']:.1f} s "
                      f"(model load {pl['load_seconds']:.1f} s); unsolved share at version 0 {_r(pl['unsolved'])}, "
                      f"never solved {_r(pl['never_solved'])}, over the run {_r(report.get('learning', {}).get('unsolved_over_run', {}))}")
    if report.get("history"):
        console.print(f"history: {report['history']['path']} ({report['history']['source']})")
    for n in report.get("notes", []):
        console.print(f"[yellow]note[/]: {n}")
