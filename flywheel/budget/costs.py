"""What one trajectory costs, per domain and split: the :class:`Cost` record, its mean over measured
trajectories (:func:`mean_cost`), and the costs a finished run's report holds (:func:`history_costs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from flywheel.budget.trajectories import TRAIN, issued_training_groups


COST_KEYS = ("samples", "generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls")
"""Keys of ``GET /v1/status`` ``cost.<split>`` (and so of a report's ``cost``): what a run actually spent."""


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
