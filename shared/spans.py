"""The local span store: one SQLite file that every process of an embedded system writes its spans to.

Written by :class:`SqliteSpanExporter` (an OpenTelemetry ``SpanExporter`` behind a
``BatchSpanProcessor``, installed by :func:`shared.telemetry.setup_tracing` when ``telemetry.traces``
is ``local``, or ``auto`` without an OTLP endpoint), read by :class:`SpanStore` (the dashboard's group
timeline, tests, a person with ``sqlite3``). The file is ``settings.run.path(settings.telemetry.span_store)``,
``<run dir>/traces.sqlite`` by default, in WAL mode, so the five services write it at once and readers
never block them.

One table, one row per finished span::

    spans(trace_id TEXT, span_id TEXT PRIMARY KEY, parent_id TEXT, name TEXT, service TEXT,
          start_ns INTEGER, end_ns INTEGER, status TEXT, attributes TEXT /*JSON*/, group_id TEXT)

``trace_id`` is 32 lower-case hex digits, ``span_id`` and ``parent_id`` 16 (``parent_id`` NULL for a
root span); ``start_ns``/``end_ns`` are Unix nanoseconds; ``status`` is ``UNSET``, ``OK`` or ``ERROR``
(a description goes to the attribute ``otel.status_description``); ``service`` is the resource's
``service.name``; ``group_id`` copies the span's ``group_id`` attribute (NULL when it has none). There
is one trace per group: the scheduler's ``issue_group`` span is its root.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

COLUMNS = ("trace_id", "span_id", "parent_id", "name", "service", "start_ns", "end_ns", "status", "attributes",
           "group_id")
"""The columns of ``spans``, in table order (each dict :class:`SpanStore` returns has these keys)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id TEXT, span_id TEXT PRIMARY KEY, parent_id TEXT, name TEXT, service TEXT,
    start_ns INTEGER, end_ns INTEGER, status TEXT, attributes TEXT, group_id TEXT
);
CREATE INDEX IF NOT EXISTS spans_trace ON spans(trace_id);
CREATE INDEX IF NOT EXISTS spans_group ON spans(group_id);
CREATE INDEX IF NOT EXISTS spans_roots ON spans(start_ns) WHERE parent_id IS NULL;
"""
"""The table and its indexes (trace, group, and the root spans by start time for :meth:`SpanStore.recent_groups`)."""

_INSERT = f"INSERT OR REPLACE INTO spans ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


def span_row(span: ReadableSpan) -> tuple:
    """The ``spans`` row of a finished SDK span (values in :data:`COLUMNS` order).

    Attribute values that JSON cannot hold are written as their ``str``.
    """
    ctx, parent = span.context, span.parent
    attrs: dict[str, Any] = dict(span.attributes or {})
    status = span.status
    if status.description:
        attrs["otel.status_description"] = status.description
    service = span.resource.attributes.get("service.name") if span.resource is not None else None
    gid = attrs.get("group_id")
    return (
        f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{parent.span_id:016x}" if parent is not None else None,
        span.name, service, span.start_time, span.end_time, status.status_code.name,
        json.dumps(attrs, default=str, separators=(",", ":")), None if gid is None else str(gid),
    )


def connect(path: str | Path, busy_timeout_s: float = 10.0) -> sqlite3.Connection:
    """Open (creating it and its directory if needed) the span store at ``path`` for writing: WAL journal,
    ``busy_timeout_s`` busy timeout (seconds a writer waits for another process's write lock), the schema.

    Raises:
        sqlite3.Error: the file cannot be opened, is not a database, or stays locked past the timeout.
        OSError: its directory cannot be created.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(p, timeout=busy_timeout_s, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across a process crash
        conn.executescript(SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


class SqliteSpanExporter(SpanExporter):
    """An OpenTelemetry span exporter that inserts every span into the SQLite span store at ``path``.

    Meant to sit behind a ``BatchSpanProcessor`` (one ``executemany`` transaction per batch, off the
    service's thread). It never raises into the service: when an export fails (the disk is full, the
    file is locked past ``busy_timeout_s``, it is not a database) the batch is dropped and counted in
    :attr:`dropped`, the first failure of a run of failures is logged as a warning (the rest at debug
    level) and the next export reconnects. Thread-safe: ``force_flush`` exports from the caller's thread.

    Retention: after every ``prune_every`` spans this process wrote, the store keeps its newest
    ``max_spans`` spans (by insertion order, over all processes) and deletes the rest, so a long run's
    store stays bounded (about 470 bytes a span, indexes included: 500,000 spans ≈ 235 MB).

    Args:
        path: the SQLite file (created with its directory on the first export).
        busy_timeout_s: seconds an insert waits for another writer's lock before it fails.
        max_spans: spans the store keeps at most (``None``: no limit).
        prune_every: spans this process writes between two retention passes.
    """

    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0, max_spans: int | None = None,
                 prune_every: int = 10_000) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.max_spans = max_spans
        self.prune_every = prune_every
        self._since_prune = 0
        self.exported = 0
        """Spans written so far."""
        self.dropped = 0
        """Spans dropped because an export failed."""
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._failing = False
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Insert ``spans`` in one transaction; ``FAILURE`` (nothing written, spans dropped) on any error."""
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            try:
                rows = [span_row(s) for s in spans]
                if self._conn is None:
                    self._conn = connect(self.path, self.busy_timeout_s)
                with self._conn:
                    self._conn.executemany(_INSERT, rows)
                self._since_prune += len(rows)
                if self.max_spans is not None and self._since_prune >= self.prune_every:
                    self._since_prune = 0
                    with self._conn:
                        self._conn.execute("DELETE FROM spans WHERE rowid <= (SELECT max(rowid) FROM spans) - ?",
                                           (self.max_spans,))
            except Exception as e:  # noqa: BLE001 - tracing must never take a service down
                self.dropped += len(spans)
                self._reset()
                if not self._failing:
                    log.warning("span store %s: dropping %d spans: %s: %s (logged once until it recovers)",
                                self.path, len(spans), type(e).__name__, e)
                else:
                    log.debug("span store %s: dropping %d spans: %r", self.path, len(spans), e)
                self._failing = True
                return SpanExportResult.FAILURE
            if self._failing:
                log.warning("span store %s: writing again (%d spans dropped so far)", self.path, self.dropped)
                self._failing = False
            self.exported += len(rows)
            return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here (the processor holds the queue): always ``True``."""
        return True

    def shutdown(self) -> None:
        """Close the connection; later exports fail (and drop their spans)."""
        with self._lock:
            self._closed = True
            self._reset()

    def _reset(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None


class SpanStore:
    """Reads the span store at ``path`` (the dashboard's group timeline, tests).

    Every method opens its own short connection, so one store may be used from any thread while the
    services write. A file that does not exist yet, or has no table yet, reads as empty. Each span comes
    back as a dict with the keys :data:`COLUMNS`, ``attributes`` decoded to a dict.

    Raises (every method):
        sqlite3.DatabaseError: the file is not a span store, or stays locked past the busy timeout.
    """

    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s

    def trace(self, trace_id: str) -> list[dict]:
        """Every span of trace ``trace_id`` (32 hex digits), by start time."""
        return self._spans(f"SELECT {', '.join(COLUMNS)} FROM spans WHERE trace_id = ? ORDER BY start_ns, end_ns",
                          (trace_id.lower(),))

    def group_trace(self, group_id: str) -> list[dict]:
        """Every span of the trace that holds group ``group_id``, by start time; ``[]`` if none does.

        A re-issued group (``attempt`` > 1) has one trace per attempt: this is the trace of its latest
        root (``issue_group``) span, or of its latest span when no root is stored.
        """
        rows = self._query("SELECT trace_id FROM spans WHERE group_id = ? "
                           "ORDER BY parent_id IS NOT NULL, start_ns DESC LIMIT 1", (group_id,))
        return self.trace(rows[0][0]) if rows else []

    def recent_groups(self, limit: int = 50) -> list[dict]:
        """The ``limit`` most recently issued groups (root spans with a ``group_id``), newest first.

        Each dict has ``group_id``, ``trace_id``, ``domain`` and ``purpose`` (the root's attributes,
        ``None`` when missing), ``start_ns`` and ``end_ns`` (the earliest start and latest end over the
        trace's spans so far, Unix ns), ``spans`` (how many) and ``services`` (sorted names).
        """
        rows = self._query(
            "WITH roots AS (SELECT trace_id, group_id, attributes, start_ns FROM spans "
            "  WHERE parent_id IS NULL AND group_id IS NOT NULL ORDER BY start_ns DESC LIMIT ?) "
            "SELECT r.group_id, r.trace_id, r.attributes, MIN(s.start_ns), MAX(s.end_ns), COUNT(*), "
            "  GROUP_CONCAT(DISTINCT s.service) "
            "FROM roots r JOIN spans s ON s.trace_id = r.trace_id GROUP BY r.trace_id ORDER BY r.start_ns DESC",
            (int(limit),))
        out = []
        for gid, tid, attrs, start, end, n, services in rows:
            a = _decode(attrs)
            out.append({"group_id": gid, "trace_id": tid, "domain": a.get("domain"), "purpose": a.get("purpose"),
                        "start_ns": start, "end_ns": end, "spans": n,
                        "services": sorted((services or "").split(",")) if services else []})
        return out

    def _spans(self, sql: str, args: tuple) -> list[dict]:
        return [dict(zip(COLUMNS, row[:-2] + (_decode(row[-2]), row[-1]))) for row in self._query(sql, args)]

    def _query(self, sql: str, args: tuple) -> list[tuple]:
        if not self.path.exists():
            return []
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):  # a writer has created the file but not the table yet
                return []
            raise
        finally:
            conn.close()


def _decode(attributes: str | None) -> dict:
    if not attributes:
        return {}
    try:
        out = json.loads(attributes)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}
