"""Logging and OpenTelemetry tracing, with the trace context carried in Kafka record headers.

Spans are created with the OpenTelemetry SDK; an exporter is attached only when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and the OTLP exporter package is installed (cluster
profile). The W3C ``traceparent`` header travels in every Kafka record, so a trace follows a
group from the scheduler through rollout and verification to the trainer.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Iterable

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

_configured = False


def setup_tracing(service: str) -> trace.Tracer:
    """Install a tracer provider for ``service`` (once per process) and return its tracer."""
    global _configured
    if not _configured:
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            try:  # optional: only in the cluster image
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                from opentelemetry.sdk.trace.export import BatchSpanProcessor

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            except ImportError:
                logging.getLogger(service).warning("OTLP exporter not installed; spans are not exported")
        trace.set_tracer_provider(provider)
        _configured = True
    return trace.get_tracer(service)


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


def setup_logging(service: str, level: str = "INFO", log_dir: str | os.PathLike | None = None) -> logging.Logger:
    """Structured log lines (time, service, level, trace id, message) to stderr and ``log_dir/<service>.log``."""
    fmt = logging.Formatter("%(asctime)s %(service)s %(levelname)s trace=%(trace_id)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / f"{service}.log"))
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(_TraceFilter(service))
        root.addHandler(h)
    root.setLevel(level)
    for noisy in ("aiokafka", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(service)
