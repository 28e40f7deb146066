"""Logging and OpenTelemetry tracing, with the trace context carried in Kafka record headers.

Spans are created with the OpenTelemetry SDK and exported by ``telemetry.traces``
(:class:`shared.config.TelemetryConfig`): ``local`` writes them to the SQLite span store
(:mod:`shared.spans`, ``<run dir>/traces.sqlite``), ``otlp`` sends them to an OpenTelemetry collector at
``$OTEL_EXPORTER_OTLP_ENDPOINT`` (compose: on to Jaeger), ``auto`` is ``otlp`` when that variable is set
and ``local`` otherwise, ``off`` records nothing (spans and their context still flow). The W3C
``traceparent`` header travels in every Kafka record and in the HTTP calls to the sandbox, so one trace
follows a group from the scheduler through rollout, verification (and the sandbox) to the trainer.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterable

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from shared.config import RunConfig, TelemetryConfig

_provider: TracerProvider | None = None
_recording = True
"""Set by :func:`setup_tracing`: an exporter is attached (:func:`recording`)."""

SCHEDULE_DELAY_MS = 1000
"""How often the batch processor writes the local span store (ms; ``$OTEL_BSP_SCHEDULE_DELAY`` overrides):
the dashboard's timeline lags by at most this."""


def build_tracer_provider(service: str, telemetry_cfg: TelemetryConfig | None = None,
                          run_cfg: RunConfig | None = None) -> TracerProvider:
    """A tracer provider for ``service`` with the exporter that ``telemetry_cfg.traces`` picks (not installed).

    ``local`` (and ``auto`` without ``$OTEL_EXPORTER_OTLP_ENDPOINT``) batches spans into the span store
    ``run_cfg.path(telemetry_cfg.span_store)`` (relative to the working directory when ``run_cfg`` is
    None); ``otlp`` batches them to the OTLP/HTTP exporter; ``off`` attaches no exporter. Without
    ``telemetry_cfg``: ``otlp`` when the variable is set, else no exporter (a bare process such as a test's
    app has no run directory to write to). A missing OTLP exporter package is logged, not raised.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    endpoint = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    mode = telemetry_cfg.traces if telemetry_cfg is not None else ("otlp" if endpoint else "off")
    if mode == "auto":
        mode = "otlp" if endpoint else "local"
    if mode == "local":
        from shared.spans import SqliteSpanExporter

        tcfg = telemetry_cfg if telemetry_cfg is not None else TelemetryConfig()
        sub = tcfg.span_store
        path = run_cfg.path(sub) if run_cfg is not None else Path(os.path.expanduser(sub)).resolve()
        delay = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MS))
        exporter = SqliteSpanExporter(path, max_spans=tcfg.span_store_max_spans)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay))
    elif mode == "otlp":
        try:  # the OTLP/HTTP exporter is a dependency, but keep a process without it running
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            logging.getLogger(service).warning("OTLP exporter not installed; spans are not exported")
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def setup_tracing(service: str, telemetry_cfg: TelemetryConfig | None = None,
                  run_cfg: RunConfig | None = None) -> trace.Tracer:
    """Install the tracer provider of :func:`build_tracer_provider` (once per process: later calls keep
    the first provider) and return ``service``'s tracer. Services pass their ``settings.telemetry`` and
    ``settings.run``; call :func:`flush_tracing` on the way out."""
    global _provider, _recording
    if _provider is None:
        _provider = build_tracer_provider(service, telemetry_cfg, run_cfg)
        trace.set_tracer_provider(_provider)
        # the SDK keeps its processors privately; when that changes, assume spans are exported
        processors = getattr(getattr(_provider, "_active_span_processor", None), "_span_processors", None)
        _recording = processors is None or bool(processors)
    return trace.get_tracer(service)


def recording() -> bool:
    """Whether this process's spans go anywhere (an exporter is attached: ``telemetry.traces`` is not
    ``off``). A hot loop may skip making spans when not: :func:`trace_headers` passes the context on."""
    return _recording


_TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(headers: Iterable[tuple[str, bytes]] | None) -> list[tuple[str, bytes]]:
    """The W3C trace-context headers of a Kafka record, to pass on unchanged (the context flows through a
    process that records no span: the next span downstream is a child of the last one recorded)."""
    return [(k, v) for k, v in (headers or ()) if k in _TRACE_HEADERS]


def flush_tracing(timeout_s: float = 5.0) -> bool:
    """Export the spans still queued by this process's provider (at most ``timeout_s`` seconds; blocks the
    caller). Returns False when nothing is installed or the flush timed out. The provider stays usable
    (the SDK shuts it down at interpreter exit, flushing again)."""
    if _provider is None:
        return False
    return _provider.force_flush(int(timeout_s * 1000))


def untraced_request(scope: dict) -> bool:
    """FastAPI's telemetry ``exclude`` hook (:data:`HTTP_TELEMETRY`): True (no span) for a read (``GET``,
    ``HEAD``) that continues no trace, i.e. has no ``traceparent`` header: health checks, Prometheus
    scrapes, status and dashboard polls, which would otherwise each add a one-span trace to the store."""
    if scope.get("type") != "http" or scope.get("method") not in ("GET", "HEAD"):
        return False
    return not any(k == b"traceparent" for k, _ in scope.get("headers") or ())


HTTP_TELEMETRY = {"operation_spans": False, "exclude": untraced_request}
"""``FastAPI(telemetry=...)`` of the scheduler and the sandbox. FastAPI's built-in telemetry (0.165, installed
here) traces every request once a tracer provider is installed: keep the server span (``POST /v1/execute``, a child of the
caller's ``traceparent``), skip its per-operation spans (dependencies, endpoint, serialization) and
untraced reads (:func:`untraced_request`). FastAPI versions without it keep the argument in
``app.extra`` and ignore it."""


def inject_headers() -> list[tuple[str, bytes]]:
    """Kafka headers carrying the current span's W3C trace context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()]


def extract_context(headers: Iterable[tuple[str, bytes]] | None) -> otel_context.Context:
    """OpenTelemetry context from a Kafka record's headers (an empty context when none)."""
    carrier = {k: v.decode(errors="replace") for k, v in (headers or ())}
    return propagate.extract(carrier)


class _TraceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else "-"
        record.service = self.service
        return True


class RateLimitFilter(logging.Filter):
    """Lets through at most ``burst`` records of one kind per ``window_s`` from the loggers under ``prefixes``
    (a kind: logger, level and the unformatted message, so every "Unable connect to node %s" is one kind); the
    first record let through after a suppression says how many were dropped. Other loggers pass untouched.

    Why: while the broker is away aiokafka logs every failed connection attempt of every client, about 3,800
    ERROR lines a minute in one trainer, which a long outage turns into a full disk; the services' own
    broker watch already says once that the broker is gone and when it is back.

    One instance serves every handler: the decision is made once per record and kept on it.
    """

    def __init__(self, prefixes: tuple[str, ...] = ("aiokafka",), burst: int = 5, window_s: float = 60.0,
                 clock=None) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.burst = burst
        self.window_s = window_s
        self.clock = clock or time.monotonic
        self._seen: dict[tuple[str, int, str], list[float]] = {}
        """kind -> [window start, records let through in it, records suppressed since the last one let through]"""

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = getattr(record, "_flywheel_rate_limit", None)
        if verdict is not None:
            return verdict
        if not record.name.startswith(self.prefixes):
            verdict = True
        else:
            key = (record.name, record.levelno, str(record.msg))
            now = self.clock()
            st = self._seen.get(key)
            if st is None or now - st[0] >= self.window_s:
                st = self._seen[key] = [now, 0, st[2] if st else 0]
            verdict = st[1] < self.burst
            if verdict:
                st[1] += 1
                if st[2]:
                    record.msg = f"{record.msg} [{st[2]} more like this suppressed]"
                    st[2] = 0
            else:
                st[2] += 1
            if len(self._seen) > 4096:  # kinds that stopped long ago
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
        record._flywheel_rate_limit = verdict
        return verdict


def setup_logging(service: str, level: str = "INFO", log_dir: str | os.PathLike | None = None) -> logging.Logger:
    """Structured log lines (time, service, level, trace id, message) to stderr and ``log_dir/<service>.log``;
    aiokafka's repeated lines are rate-limited (:class:`RateLimitFilter`)."""
    fmt = logging.Formatter("%(asctime)s %(service)s %(levelname)s trace=%(trace_id)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / f"{service}.log"))
    limit = RateLimitFilter()
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(limit)
        h.addFilter(_TraceFilter(service))
        root.addHandler(h)
    root.setLevel(level)
    for noisy in ("aiokafka", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(service)
