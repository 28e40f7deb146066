"""Prometheus metrics helpers shared by the five services (``prometheus-client``).

Each service keeps its metric families in ``<service>/metrics.py``, on a
:class:`prometheus_client.CollectorRegistry` of its own (one per service run, so two runs in one test
process never add up), and builds that object in its ``run()``. This module holds what they share:

- **Names**: ``flywheel_<area>_<what>_<unit>`` (``flywheel_verifier_verify_seconds``,
  ``flywheel_scheduler_groups_issued_total``); counters end in ``_total``, times are seconds,
  staleness is policy versions.
- **Bounded domain labels**: :class:`DomainLabels` (one per service's metrics object,
  :class:`ServiceMetrics`). A run may have hundreds of domains and every label value is a
  time series in Prometheus, so the first :data:`MAX_DOMAINS` distinct domain names keep their own label
  value and every later one gets :data:`OTHER` (``"other"``). A labelled family therefore has at most
  ``MAX_DOMAINS + 1`` domain values per process, whatever the run. Which domains get their own value
  depends on the order they are first seen (a restart may pick others); ``sum`` over the domain label
  still gives exact run totals.
- **Serving**: the scheduler and the sandbox answer ``GET /metrics`` on their own API (:func:`render`);
  rollout, verifier and trainer start a small HTTP server on ``telemetry.metrics_host:metrics_port``
  (:func:`serve_metrics`).
- **Reading**: :func:`scrape` and :func:`parse` turn an exposition into ``{sample name: [(labels, value)]}``
  (tests, the Grafana dashboard check).

Cost: a labelled counter increment is one dict lookup and one lock of prometheus-client's own (about
a microsecond); nothing here runs per token, and gauges that need a database read are computed when
scraped, not on the hot path.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import httpx
from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from shared.config import TelemetryConfig

log = logging.getLogger(__name__)

MAX_DOMAINS = 128
"""Distinct domain label values a process gives out before :data:`OTHER` (see the module docstring)."""
OTHER = "other"
"""The label value of every domain past the first :data:`MAX_DOMAINS`."""
NO_DOMAIN = "none"
"""The label value of a record without a domain (``None`` or empty)."""

SECONDS_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets (seconds) for calls that usually take milliseconds: a verification, a sandbox run."""
SECONDS_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Histogram buckets (seconds) for work that takes up to minutes: a generation batch, a trainer phase."""
CONTENT_TYPE_PLAIN = CONTENT_TYPE_PLAIN_0_0_4
"""``text/plain; version=0.0.4; charset=utf-8``: what every service answers a plain ``GET /metrics`` with."""
VERSIONS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
"""Histogram buckets (policy versions) for staleness: policy version − behaviour version, an integer."""


class DomainLabels:
    """The first ``cap`` distinct domain names keep their name as a label value; later ones get :data:`OTHER`.

    Thread-safe; a name already seen is answered without a lock (the hot path), a new one takes a lock once.

    Args:
        cap: distinct names given their own value (≥ 0).

    Raises:
        ValueError: ``cap`` is negative.
    """

    def __init__(self, cap: int = MAX_DOMAINS) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        self.cap = cap
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str | None) -> str:
        """The label value of domain ``name``: itself while fewer than ``cap`` names were kept (or it was),
        :data:`OTHER` after; :data:`NO_DOMAIN` for ``None`` or ``""``."""
        if not name:
            return NO_DOMAIN
        if name in self._kept:
            return name
        with self._lock:
            if name in self._kept:
                return name
            if len(self._kept) < self.cap:
                self._kept.add(name)
                return name
        return OTHER

    @property
    def kept(self) -> frozenset[str]:
        """The names that have their own label value."""
        return frozenset(self._kept)


def process_registry() -> CollectorRegistry:
    """A fresh registry with the process collector (``process_cpu_seconds_total``,
    ``process_resident_memory_bytes``, open fds...) registered; a service adds its families to it.

    Counters' ``…_created`` series are switched off for the process (they double the series and no
    dashboard reads them)."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    return registry


class ServiceMetrics:
    """Base of a service's metric families (``<service>/metrics.py``): one registry per service run and the
    bounded domain label its families use; a subclass adds its families to :attr:`registry`.

    Args:
        registry: where the families go; default a fresh :func:`process_registry`.
        max_domains: distinct domain label values before ``other``.
    """

    def __init__(self, registry: CollectorRegistry | None = None, max_domains: int = MAX_DOMAINS) -> None:
        self.registry = registry if registry is not None else process_registry()
        self.domain = DomainLabels(max_domains)
        """The bounded domain label of this registry's families."""


def render(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """``(body, content type)`` of ``registry`` for a ``GET /metrics`` route, in the format the request's
    ``Accept`` header asks for, negotiated as prometheus-client's own server does: the Prometheus text
    format 0.0.4 (:data:`CONTENT_TYPE_PLAIN`) unless OpenMetrics or text 1.0.0 is asked for."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


@dataclass
class MetricsServer:
    """A running metrics HTTP server (a daemon thread); :meth:`close` stops it."""

    port: int
    """The port it listens on."""
    _server: object

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def serve_metrics(cfg: TelemetryConfig, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve ``registry`` on ``http://cfg.metrics_host:cfg.metrics_port/metrics`` (any path answers)
    when ``cfg.metrics`` is on and the port is > 0; ``None`` otherwise.

    Raises:
        OSError: the port cannot be bound.
    """
    if not cfg.metrics or cfg.metrics_port <= 0:
        return None
    server, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=registry)
    port = server.server_address[1]
    log.info("Prometheus metrics on http://%s:%d/metrics", cfg.metrics_host, port)
    return MetricsServer(port, server)


Samples = dict[str, list[tuple[dict[str, str], float]]]
"""``{sample name: [(labels, value), ...]}``: sample names as PromQL sees them (``…_total``,
``…_bucket``, ``…_sum``, ``…_count``, or the gauge's name)."""


def parse(text: str) -> Samples:
    """The samples of a Prometheus text exposition (see :data:`Samples`).

    Raises:
        ValueError: the text is not in the Prometheus text format.
    """
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, [])  # a family with no sample yet (a labelled counter never incremented)
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def families(text: str) -> dict[str, str]:
    """``{family name: type}`` of a Prometheus text exposition (``counter`` families are named
    without ``_total``, as prometheus-client's parser gives them)."""
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """``GET url`` and :func:`parse` it.

    Raises:
        httpx.HTTPError: the request failed or answered an error status.
        ValueError: the answer is not in the Prometheus text format.
    """
    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    return parse(r.text)


def total(samples: Samples, name: str, where: Callable[[dict[str, str]], bool] | None = None) -> float:
    """The sum of sample ``name``'s values whose labels pass ``where`` (all when ``None``); 0 when absent."""
    return sum(v for labels, v in samples.get(name, ()) if where is None or where(labels))


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    """The values label ``label`` takes over sample ``name``."""
    return {labels[label] for labels, _ in samples.get(name, ()) if label in labels}
