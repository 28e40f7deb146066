"""``/dashboard``: a live web page of the run, and the JSON it polls under ``/v1/dashboard/...``.

The page (``scheduler_service/dashboard/``: plain HTML, JS and CSS, no build step) draws its charts with
plotly.js, served from the installed ``plotly`` Python package (``/dashboard/plotly.min.js``: no CDN, so it
works on a cluster without internet). It polls :func:`dashboard_data` every few seconds and redraws with
``Plotly.react``.

Cheap for the scheduler: one payload is built at most every :data:`CACHE_S` seconds whatever the number of
open pages; the training curves are kept as running sums fed by the reward rows stored since the last build
(:class:`scheduler_service.dashboard_data.RewardSeries`, read in chunks of :data:`CHUNK_ROWS` so the
registry's lock is never held long); finished eval rounds are read once; alerts and breakers come from the
drift monitor's memory; every other query is indexed or has a ``LIMIT``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, Response

from scheduler_service.dashboard_data import RewardSeries
from scheduler_service.deps import StateDep
from scheduler_service.domains import spent_on
from scheduler_service.state import SchedulerState
from shared.http import CheckedRoute
from shared.spans import SpanStore

router = APIRouter(tags=["dashboard"], route_class=CheckedRoute)

STATIC = Path(__file__).resolve().parents[1] / "dashboard"
"""The page's files (package data of ``scheduler_service``)."""
CACHE_S = 2.0
"""Seconds one built payload is served before the next is built."""
CHUNK_ROWS = 1000
"""Reward rows read per registry query: one short hold of the registry lock (about 10 ms of CPU, measured
with 200,000 rows; accounting them costs as much again, outside the lock)."""
CATCH_UP_S = 0.2
"""Seconds one build may spend reading new reward rows (the rest waits for the next build)."""
RECENT_ALERTS = 30
"""Newest alert records (firing and resolved) in the alerts table, besides those firing now."""
RECENT_TRACES = 30
"""Recent groups offered by the timeline's picker."""
HISTORY = 2000
"""Newest trainer Metrics records read (staleness histogram, trained throughput)."""
_FILES = {"": ("index.html", "text/html"), "dashboard.js": ("dashboard.js", "text/javascript"),
          "dashboard.css": ("dashboard.css", "text/css")}


def plotly_js() -> Path:
    """``plotly/package_data/plotly.min.js`` of the installed plotly package (found without importing it).

    Raises:
        FileNotFoundError: plotly is not installed, or ships no bundled plotly.js.
    """
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the plotly package is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


@router.get("/dashboard", include_in_schema=False)
@router.get("/dashboard/{name}", include_in_schema=False)
def dashboard_file(name: str = "") -> FileResponse:
    """The page (``/dashboard``), its script and style, and plotly.js (cached by the browser for a day)."""
    if name == "plotly.min.js":
        try:
            return FileResponse(plotly_js(), media_type="text/javascript",
                                headers={"Cache-Control": "public, max-age=86400"})
        except FileNotFoundError as e:
            raise HTTPException(404, f"plotly.js not found ({e}): pip install plotly") from None
    if name not in _FILES:
        raise HTTPException(404, f"no dashboard file {name!r}")
    file, media = _FILES[name]
    return FileResponse(STATIC / file, media_type=media, headers={"Cache-Control": "no-cache"})


class DashboardCache:
    """The newest payload, the reward series behind it, and the finished eval rounds (one per app)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.series = RewardSeries()
        self.payload: dict[str, Any] | None = None
        self.body = b""
        """:attr:`payload` as JSON (encoded once per build)."""
        self.built = -math.inf
        """``time.monotonic()`` of the last build."""
        self.evals: dict[int, dict[str, Any]] = {}
        """Finished eval rounds by id (they no longer change)."""

    def fresh(self) -> bytes | None:
        """The payload as JSON while it is younger than :data:`CACHE_S`, else ``None`` (no lock: for the
        event loop)."""
        body, built = self.body, self.built
        return body if body and time.monotonic() - built < CACHE_S else None

    def get(self, state: SchedulerState) -> bytes:
        """The payload as JSON, rebuilt when older than :data:`CACHE_S` (one build at a time; the others wait).
        Blocking: call it from a worker thread."""
        with self.lock:
            if self.payload is None or time.monotonic() - self.built >= CACHE_S:
                t0 = time.perf_counter()
                self.payload = build_payload(state, self)
                self.payload["build_ms"] = (time.perf_counter() - t0) * 1e3
                self.body = orjson.dumps(self.payload, option=orjson.OPT_NON_STR_KEYS)
                self.built = time.monotonic()
            return self.body


def _cache(request: Request) -> DashboardCache:
    c = getattr(request.app.state, "dashboard", None)
    if c is None:
        c = request.app.state.dashboard = DashboardCache()
    return c


@router.get("/v1/dashboard/data", response_class=Response)
async def dashboard_data(request: Request, state: StateDep) -> Response:
    """Everything the page draws, built at most every :data:`CACHE_S` s: ``status`` (the header),
    ``curves`` (per domain, over behaviour policy versions: ``reward_mean``, ``pass_rate``, ``length_mean``
    in tokens, ``diversity``), ``evals`` (held-out accuracy per round, run-wide and per domain),
    ``staleness`` (the trainer's histogram of trainer version minus behaviour version, summed over steps),
    ``throughput`` (``scored``: samples/s and groups/s at the scheduler; ``trained``: samples/s and
    groups/s per trainer step), ``alerts`` (``active``, ``recent``), ``breakers`` (one row per domain),
    ``spend`` (per domain and purpose, with the training budget's caps) and ``traces`` (recent groups in
    the span store). ``build_ms``: how long building it took. A fresh payload is served from the event loop;
    a build runs in a worker thread."""
    cache = _cache(request)
    body = cache.fresh() or await asyncio.to_thread(cache.get, state)
    return Response(body, media_type="application/json")


def build_payload(state: SchedulerState, cache: DashboardCache) -> dict[str, Any]:
    """One dashboard payload (see :func:`dashboard_data`); reads the reward rows stored since the last."""
    reg = state.registry
    deadline = time.perf_counter() + CATCH_UP_S
    while cache.series.add(reg.reward_rows_after(cache.series.cursor, CHUNK_ROWS)) == CHUNK_ROWS:
        if time.perf_counter() > deadline:
            break
    now = time.time()
    history = state.stats.history()[-HISTORY:]
    return {
        "time": now,
        "status": _status(state, cache, history),
        "curves": cache.series.curves(),
        "evals": _evals(state, cache),
        "staleness": _staleness(history),
        "throughput": {"scored": cache.series.throughput(now), "trained": _trained(history),
                       "bin_s": cache.series.bin_s},
        "alerts": _alerts(state),
        "breakers": _breakers(state),
        "spend": _spend(state),
        "traces": _traces(state),
    }


def _status(state: SchedulerState, cache: DashboardCache, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The header: key/value and in-memory reads, and the training groups in flight (an indexed count)."""
    reg = state.registry
    last = history[-1] if history else None
    return {"policy_version": reg.policy_version, "trainer_step": last["step"] if last else None,
            "training_paused": reg.training_pause(), "samples_scored": cache.series.scored,
            "in_flight_groups": sum(g for g, _ in reg.in_flight_by_domain().values()),
            "throughput_samples_per_s": state.stats.throughput(),
            "paused_domains": {d: v["reason"] for d, v in reg.paused_domains().items()}, "kafka": state.kafka}


def _evals(state: SchedulerState, cache: DashboardCache) -> list[dict[str, Any]]:
    """Every eval round: accuracy run-wide and per domain, at the newest policy version that answered."""
    reg = state.registry
    rid = next((i for i in range(len(cache.evals) + 1) if i not in cache.evals), 0)
    fresh = {}
    while (r := reg.eval_round(rid)) is not None:
        per = reg.eval_accuracy_by_domain(rid)
        entry = {"eval_round": rid, "policy_version": max(r["policy_versions"], default=r["min_policy_version"]),
                 "accuracy": r["accuracy"], "n": r["n"], "completed": r["completed"], "done": r["done"],
                 "domains": {d: {"accuracy": c / n if n else None, "completed": n}
                             for d, (c, n) in sorted(per.items())}}
        (cache.evals if r["done"] else fresh)[rid] = entry
        rid += 1
    return [e for _, e in sorted({**cache.evals, **fresh}.items())]


def _staleness(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The trainer's ``train/staleness_hist/<s>`` counts (samples trained s versions after the policy that
    generated them; ``trainer_service.trainer``), summed over the steps in ``history``."""
    hist: dict[int, float] = {}
    steps = 0
    for m in history:
        found = False
        for k, v in m["values"].items():
            if k.startswith("train/staleness_hist/"):
                s = int(k.rsplit("/", 1)[1])
                hist[s] = hist.get(s, 0.0) + v
                found = True
        steps += found
    return {"versions_behind": sorted(hist), "samples": [hist[s] for s in sorted(hist)], "steps": steps}


def _trained(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trainer samples/s and groups/s of each step: its ``train/samples`` and ``train/groups`` over the
    time since the previous step's record."""
    out = []
    for prev, m in zip(history, history[1:]):
        dt = m["time"] - prev["time"]
        if dt > 0:
            v = m["values"]
            out.append({"t": m["time"], "step": m["step"], "samples_per_s": v.get("train/samples", 0.0) / dt,
                        "groups_per_s": v.get("train/groups", 0.0) / dt})
    return out


def _alert_row(a) -> dict[str, Any]:
    return {"key": a.key, "time": a.time, "domain": a.domain, "signal": a.signal, "status": a.status,
            "severity": a.severity, "value": a.value, "threshold": a.threshold, "policy_version": a.policy_version,
            "message": a.message}


def _alerts(state: SchedulerState) -> dict[str, list[dict[str, Any]]]:
    active = sorted(state.guard.monitor.active.values(), key=lambda a: -a.time)
    return {"active": [_alert_row(a) for a in active],
            "recent": [_alert_row(a) for a in state.registry.alert_history(limit=RECENT_ALERTS)]}


def _breakers(state: SchedulerState) -> list[dict[str, Any]]:
    """Each domain's breaker (closed when it never opened) and why the domain is paused, if it is."""
    mon = state.guard.monitor
    rows = state.registry.domain_rows()
    out = []
    for d in sorted(set(rows) | set(mon.breakers)):
        b, row = mon.breaker(d), rows.get(d)
        out.append({"domain": d, "state": b.state, "since": b.since or None, "signal": b.signal, "trips": b.trips,
                    "manual": b.manual, "domain_state": row.config.state if row else None,
                    "pause_reason": row.pause_reason if row else None})
    return out


def _spend(state: SchedulerState) -> list[dict[str, Any]]:
    """Spend per domain and purpose (``samples``, ``generated_tokens``, ``sandbox_seconds``...), with the
    domain's training budget caps (``budget``: key → cap) next to its ``train`` row."""
    rows = state.registry.domain_rows()
    out = []
    for d, per in sorted(state.registry.spend().items()):
        caps = rows[d].config.budget.model_dump(exclude_none=True) if d in rows else {}
        for purpose, vals in sorted(per.items()):
            budget = ({k: {"cap": cap, "spent": spent_on(k, vals)} for k, cap in caps.items()}
                      if purpose == "train" else {})
            out.append({"domain": d, "purpose": purpose, **vals, "budget": budget})
    return out


def _span_store(state: SchedulerState) -> SpanStore:
    """The local span store (a file not written yet reads as empty)."""
    return SpanStore(state.config.run.path(state.config.telemetry.span_store))


def _traces(state: SchedulerState) -> dict[str, Any]:
    """The span store's :data:`RECENT_TRACES` newest groups, newest first (``group_id``, ``trace_id``, ``domain``,
    ``purpose``, ``start_ns``, ``end_ns``, ``spans``, ``services``: :meth:`shared.spans.SpanStore.recent_groups`).
    ``available``: the store's file exists (spans go to it: ``telemetry.traces`` local, or auto without OTLP)."""
    store = _span_store(state)
    return {"available": store.path.is_file(), "groups": store.recent_groups(RECENT_TRACES)}


@router.get("/v1/dashboard/trace/{group_id:path}")
def dashboard_trace(group_id: str, state: StateDep) -> dict[str, Any]:
    """One group's timeline from its trace: every span of the trace that holds the group, in start order,
    with ``start_ms`` (from the trace's first span) and ``duration_ms``. An empty timeline when the span store
    is not written (yet) or holds no span of the group."""
    spans = sorted(_span_store(state).group_trace(group_id), key=lambda sp: sp["start_ns"])
    if not spans:
        return {"group_id": group_id, "trace_id": None, "t0_ns": None, "services": [], "spans": []}
    t0 = spans[0]["start_ns"]
    out = [{"span_id": sp["span_id"], "parent_id": sp["parent_id"], "service": sp["service"], "name": sp["name"],
            "start_ms": (sp["start_ns"] - t0) / 1e6,
            "duration_ms": max((sp["end_ns"] or sp["start_ns"]) - sp["start_ns"], 0) / 1e6,
            "status": sp["status"], "attributes": sp.get("attributes") or {}} for sp in spans]
    return {"group_id": group_id, "trace_id": spans[0]["trace_id"], "t0_ns": t0,
            "services": sorted({sp["service"] for sp in spans}), "spans": out}
