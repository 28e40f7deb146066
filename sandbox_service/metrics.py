"""The sandbox's Prometheus metrics, served on its API at ``GET /metrics``.

The run latency histogram (by language) is observed once per execution; the counters, the breaker and
the slots are read when scraped (:class:`PoolCollector`), through a function the pool
(:class:`sandbox_service.pool.Pool`) hands over that returns a :class:`PoolReading`, so the execution path
does no more than it did before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.metrics import process_registry

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Buckets (seconds) of ``flywheel_sandbox_execution_seconds`` (``+Inf`` is added)."""
POOL_COUNTERS = {
    "attempts": "Executions attempted on a worker (retries included).",
    "environment_failures": "Attempts that failed in the environment (worker died or hung, torn frame, set-up).",
    "workers_started": "Worker processes started.",
    "workers_recycled": "Workers replaced after sandbox.recycle_after_runs runs.",
    "workers_found_dead": "Idle workers found dead when taken.",
    "worker_restart_gave_up": "Worker replacements given up after repeated start failures.",
    "health_checks": "Canary runs of the idle-worker health check.",
    "health_check_failures": "Health-check canaries that failed.",
    "breaker_trials": "Trial runs of the open circuit breaker.",
}
"""``Pool.counters`` keys exposed as ``flywheel_sandbox_<key>_total``, with their meaning."""


@dataclass(frozen=True)
class PoolReading:
    """The pool's state at one scrape, as :class:`PoolCollector` exposes it."""

    runs: Mapping[str, int]
    """Executions answered so far, by result status."""
    counters: Mapping[str, int]
    """The pool's counters (:data:`POOL_COUNTERS` keys; a missing key reads 0)."""
    breaker_open: int
    """1 while the circuit breaker is open or half-open, else 0."""
    busy: int
    """Workers running an execution."""
    idle: int
    """Workers waiting for an execution."""
    waiting: int
    """Executions waiting for a worker."""
    alive: int
    """Worker processes alive."""
    configured: int
    """Worker slots configured (``sandbox.max_concurrency``)."""


class SandboxMetrics:
    """The sandbox's families on one registry (one per pool).

    Args:
        read: returns the pool's state now (called at each scrape by the scrape-time families).
        registry: where the families go; default a fresh :func:`shared.metrics.process_registry`.
    """

    def __init__(self, read: Callable[[], PoolReading], registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else process_registry()
        self.execution_seconds = Histogram(
            "flywheel_sandbox_execution_seconds", "Seconds of one execution request, from admission to result "
            "(waiting for a worker and retries included), by language.", ["language"], buckets=LATENCY_BUCKETS_S,
            registry=r)
        r.register(PoolCollector(read))


class PoolCollector:
    """Families read from the pool at scrape time (``read()``): ``flywheel_sandbox_runs_total{status}``, the
    :data:`POOL_COUNTERS`, ``…_breaker_open`` (1 while open or half-open), ``…_busy_slots`` (workers running
    an execution), ``…_idle_slots`` (workers waiting for one), ``…_waiting_runs`` (executions waiting for a
    worker), ``…_workers_alive`` and ``…_workers_configured``."""

    def __init__(self, read: Callable[[], PoolReading]) -> None:
        self.read = read

    def describe(self) -> list:
        """The families without samples (registering reads nothing)."""
        return list(self._families())

    def _families(self) -> Iterator:
        yield CounterMetricFamily("flywheel_sandbox_runs", "Executions answered, by result status.", labels=["status"])
        for k, doc in POOL_COUNTERS.items():
            yield CounterMetricFamily(f"flywheel_sandbox_{k}", doc)
        yield GaugeMetricFamily("flywheel_sandbox_breaker_open", "1 while the circuit breaker refuses work.")
        yield GaugeMetricFamily("flywheel_sandbox_busy_slots", "Workers running an execution now.")
        yield GaugeMetricFamily("flywheel_sandbox_idle_slots", "Workers idle, waiting for an execution.")
        yield GaugeMetricFamily("flywheel_sandbox_waiting_runs", "Executions waiting for a worker.")
        yield GaugeMetricFamily("flywheel_sandbox_workers_alive", "Worker processes alive.")
        yield GaugeMetricFamily("flywheel_sandbox_workers_configured", "Worker slots configured "
                                "(sandbox.max_concurrency).")

    def collect(self) -> Iterator:
        """Read the pool now and yield the families."""
        p = self.read()
        fams = self._families()
        runs = next(fams)
        for status, n in p.runs.items():
            runs.add_metric([status], n)
        yield runs
        for k in POOL_COUNTERS:
            fam = next(fams)
            fam.add_metric([], p.counters[k])
            yield fam
        values = (p.breaker_open, p.busy, p.idle, p.waiting, p.alive, p.configured)
        for fam, v in zip(fams, values):
            fam.add_metric([], v)
            yield fam


SESSION_COUNTERS = {
    "sessions_started": "Sessions opened (POST /v1/sessions).",
    "sessions_ended": "Sessions ended (deleted, expired, over their disk limit, shutdown).",
    "sessions_expired": "Sessions ended by the reaper at their expires_at.",
    "snapshots": "Session snapshots taken.",
    "rollbacks": "Session rollbacks.",
}
"""``SessionStore.counters`` keys exposed as ``flywheel_sandbox_<key>_total``."""


class SessionCollector:
    """Session families read at scrape time: ``flywheel_sandbox_sessions_open``, ``…_workspaces`` (templates
    stored) and the :data:`SESSION_COUNTERS`. ``read()`` returns ``(open, templates, counters)``."""

    def __init__(self, read: Callable[[], tuple[int, int, Mapping[str, int]]]) -> None:
        self.read = read

    def describe(self) -> list:
        return list(self._families())

    def _families(self) -> Iterator:
        yield GaugeMetricFamily("flywheel_sandbox_sessions_open", "Sessions open now.")
        yield GaugeMetricFamily("flywheel_sandbox_workspaces", "Workspace templates stored.")
        for k, doc in SESSION_COUNTERS.items():
            yield CounterMetricFamily(f"flywheel_sandbox_{k}", doc)

    def collect(self) -> Iterator:
        n_open, templates, counters = self.read()
        fams = self._families()
        for v in (n_open, templates):
            fam = next(fams)
            fam.add_metric([], v)
            yield fam
        for k in SESSION_COUNTERS:
            fam = next(fams)
            fam.add_metric([], counters.get(k, 0))
            yield fam


def session_metrics(registry: CollectorRegistry, read: Callable[[], tuple[int, int, Mapping[str, int]]]) -> Histogram:
    """Register the session families on ``registry``; returns the ``flywheel_sandbox_session_op_seconds{op}``
    histogram (``start``, ``snapshot``, ``rollback``: the service's own time, without HTTP)."""
    registry.register(SessionCollector(read))
    return Histogram("flywheel_sandbox_session_op_seconds", "Seconds the service spent starting a session, taking a "
                     "snapshot or rolling back (without HTTP), by operation.", ["op"],
                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=registry)
