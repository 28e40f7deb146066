"""The SQLite span store: the exporter (several processes and threads writing one file, never raising),
the reader's methods, and the choice of exporter by ``telemetry.traces``."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from shared.config import RunConfig, TelemetryConfig
from shared.spans import COLUMNS, SpanStore, SqliteSpanExporter
from shared.telemetry import build_tracer_provider, untraced_request

REPO = Path(__file__).resolve().parents[2]


def _provider(exporter, service="svc", batch=True) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
    p.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=20, max_export_batch_size=16)
                         if batch else SimpleSpanProcessor(exporter))
    return p


def _group_trace(tracer, gid, domain="code"):
    """A small group trace: root issue_group -> rollout -> 2 verify (one with an ERROR status)."""
    with tracer.start_as_current_span("issue_group", context=otel_context.Context(),
                                      attributes={"group_id": gid, "domain": domain, "purpose": "train"}) as root:
        with tracer.start_as_current_span("rollout", attributes={"group_id": gid, "n": 2}):
            for i in range(2):
                with tracer.start_as_current_span("verify", attributes={"group_id": gid, "sample_index": i}) as v:
                    if i == 1:
                        v.set_status(Status(StatusCode.ERROR, "sandbox unreachable"))
    return root.get_span_context()


def test_exporter_writes_rows_the_reader_returns(tmp_path):
    path = tmp_path / "sub" / "traces.sqlite"
    exporter = SqliteSpanExporter(path)
    provider = _provider(exporter, "rollout")
    tracer = provider.get_tracer("t")
    ctx_a = _group_trace(tracer, "g-a", "code")
    ctx_b = _group_trace(tracer, "g-b", "toy")
    with tracer.start_as_current_span("train_step", context=otel_context.Context(), attributes={"step": 1}):
        pass  # a root without group_id: not a group
    assert provider.force_flush()
    assert exporter.exported == 9 and exporter.dropped == 0

    store = SpanStore(path)
    spans = store.trace(f"{ctx_a.trace_id:032x}")
    assert [s["name"] for s in spans] == ["issue_group", "rollout", "verify", "verify"]
    assert all(set(s) == set(COLUMNS) for s in spans)
    root, rollout, v0, v1 = spans
    assert root["parent_id"] is None and root["span_id"] == f"{ctx_a.span_id:016x}"
    assert len(root["trace_id"]) == 32 and len(root["span_id"]) == 16
    assert rollout["parent_id"] == root["span_id"] and v0["parent_id"] == v1["parent_id"] == rollout["span_id"]
    assert {s["service"] for s in spans} == {"rollout"} and {s["group_id"] for s in spans} == {"g-a"}
    assert root["attributes"] == {"group_id": "g-a", "domain": "code", "purpose": "train"}
    assert v0["status"] == "UNSET" and v1["status"] == "ERROR"
    assert v1["attributes"]["otel.status_description"] == "sandbox unreachable"
    assert root["start_ns"] <= rollout["start_ns"] <= v0["start_ns"] <= v0["end_ns"] <= root["end_ns"]

    assert [s["span_id"] for s in store.group_trace("g-b")] == [s["span_id"] for s in
                                                                store.trace(f"{ctx_b.trace_id:032x}")]
    assert store.group_trace("nope") == [] and store.trace("0" * 32) == []
    recent = store.recent_groups(10)
    assert [g["group_id"] for g in recent] == ["g-b", "g-a"]  # newest first, the train_step root left out
    assert recent[1] == {"group_id": "g-a", "trace_id": f"{ctx_a.trace_id:032x}", "domain": "code",
                         "purpose": "train", "start_ns": root["start_ns"], "end_ns": root["end_ns"], "spans": 4,
                         "services": ["rollout"]}
    assert [g["group_id"] for g in store.recent_groups(1)] == ["g-b"]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    provider.shutdown()


def test_the_store_keeps_only_its_newest_spans(tmp_path):
    path = tmp_path / "traces.sqlite"
    exporter = SqliteSpanExporter(path, max_spans=12, prune_every=8)
    provider = _provider(exporter, "rollout", batch=False)
    tracer = provider.get_tracer("t")
    for i in range(10):  # 4 spans a group, 40 in all
        _group_trace(tracer, f"g-{i}")
    assert exporter.exported == 40
    with sqlite3.connect(path) as db:
        left = db.execute("SELECT count(*) FROM spans").fetchone()[0]
    assert 12 <= left < 12 + 8  # pruned to 12 at each pass, at most prune_every added since
    store = SpanStore(path)
    assert [s["name"] for s in store.group_trace("g-9")] == ["issue_group", "rollout", "verify", "verify"]
    assert store.group_trace("g-0") == []  # the oldest group is gone
    provider.shutdown()


def test_group_trace_of_a_reissued_group_is_its_latest_attempt(tmp_path):
    provider = _provider(SqliteSpanExporter(tmp_path / "t.sqlite"), batch=False)
    tracer = provider.get_tracer("t")
    _group_trace(tracer, "g")
    second = _group_trace(tracer, "g")
    assert {s["trace_id"] for s in SpanStore(tmp_path / "t.sqlite").group_trace("g")} == {f"{second.trace_id:032x}"}


def test_reader_of_a_missing_or_empty_store_returns_nothing(tmp_path):
    assert SpanStore(tmp_path / "none.sqlite").recent_groups() == []
    sqlite3.connect(tmp_path / "empty.sqlite").close()  # a file without the table yet
    store = SpanStore(tmp_path / "empty.sqlite")
    assert store.recent_groups() == [] and store.group_trace("g") == [] and store.trace("0" * 32) == []


_WRITER = """
import sys
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from shared.spans import SqliteSpanExporter

path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
exporter = SqliteSpanExporter(path)
provider = TracerProvider(resource=Resource.create({"service.name": name}))
provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=5, max_export_batch_size=8))
tracer = provider.get_tracer(name)
for i in range(n):
    with tracer.start_as_current_span("s", attributes={"group_id": f"{name}-{i}"}):
        pass
provider.shutdown()
print(exporter.exported, exporter.dropped)
"""


def test_five_processes_write_one_store_without_losing_a_span(tmp_path):
    path, n = tmp_path / "traces.sqlite", 300
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"svc{k}", str(n)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(5)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == [str(n), "0"], err  # every span written, none dropped
    with sqlite3.connect(path) as db:
        rows = dict(db.execute("SELECT service, COUNT(DISTINCT group_id) FROM spans GROUP BY service").fetchall())
    assert rows == {f"svc{k}": n for k in range(5)}


def test_threads_and_force_flush_export_concurrently(tmp_path):
    exporter = SqliteSpanExporter(tmp_path / "traces.sqlite")
    provider = _provider(exporter)
    tracer = provider.get_tracer("t")

    def work(k):
        for i in range(200):
            with tracer.start_as_current_span("s", attributes={"group_id": f"{k}-{i}"}):
                pass
            if i % 50 == 0:
                provider.force_flush()  # exports from this thread while the worker thread exports too

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert provider.force_flush()
    assert (exporter.exported, exporter.dropped) == (800, 0)
    with sqlite3.connect(tmp_path / "traces.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == 800
    provider.shutdown()


def test_a_failing_store_drops_spans_logs_once_and_never_raises(tmp_path, caplog):
    bad = tmp_path / "not-a-db.sqlite"
    bad.write_bytes(b"this is not a SQLite file" * 100)
    exporter = SqliteSpanExporter(bad, busy_timeout_s=0.1)
    provider = _provider(exporter, batch=False)  # exports on span end, in this thread
    tracer = provider.get_tracer("t")
    with caplog.at_level(logging.WARNING, logger="shared.spans"):
        for _ in range(3):
            with tracer.start_as_current_span("s", attributes={"group_id": "g"}):
                pass
    assert (exporter.exported, exporter.dropped) == (0, 3)
    warnings = [r for r in caplog.records if r.name == "shared.spans"]
    assert len(warnings) == 1 and "dropping 1 spans" in warnings[0].getMessage()
    assert exporter.export([]) == SpanExportResult.FAILURE  # still failing, still quiet
    assert len([r for r in caplog.records if r.name == "shared.spans"]) == 1

    bad.unlink()  # the store becomes writable: the next export reconnects and says so
    with caplog.at_level(logging.WARNING, logger="shared.spans"):
        with tracer.start_as_current_span("s", attributes={"group_id": "g"}):
            pass
    assert exporter.exported == 1 and "writing again" in caplog.records[-1].getMessage()
    exporter.shutdown()
    assert exporter.export([]) == SpanExportResult.FAILURE


def _exporters(provider: TracerProvider) -> list:
    return [p.span_exporter for p in provider._active_span_processor._span_processors]


def test_traces_local_and_auto_write_the_run_dirs_store(tmp_path, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    run = RunConfig(dir=str(tmp_path / "run"))
    for mode in ("local", "auto"):
        provider = build_tracer_provider("trainer", TelemetryConfig(traces=mode), run)
        (exporter,) = _exporters(provider)
        assert isinstance(exporter, SqliteSpanExporter) and exporter.path == tmp_path / "run" / "traces.sqlite"
        with provider.get_tracer("t").start_as_current_span("s", attributes={"group_id": mode}):
            pass
        provider.shutdown()
    spans = [SpanStore(tmp_path / "run" / "traces.sqlite").group_trace(m) for m in ("local", "auto")]
    assert [[(s["name"], s["service"]) for s in g] for g in spans] == [[("s", "trainer")]] * 2
    absolute = build_tracer_provider("x", TelemetryConfig(traces="local", span_store=str(tmp_path / "a.sqlite")), run)
    assert _exporters(absolute)[0].path == tmp_path / "a.sqlite"


def test_traces_otlp_and_auto_with_an_endpoint_pick_the_otlp_exporter(tmp_path, monkeypatch):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    run = RunConfig(dir=str(tmp_path))
    for mode in ("otlp", "auto"):
        (exporter,) = _exporters(build_tracer_provider("x", TelemetryConfig(traces=mode), run))
        assert isinstance(exporter, OTLPSpanExporter)
    assert not list(tmp_path.iterdir())


def test_traces_off_records_nothing_but_context_still_flows(tmp_path, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    run = RunConfig(dir=str(tmp_path))
    for provider in (build_tracer_provider("x", TelemetryConfig(traces="off"), run),
                     build_tracer_provider("x")):  # no settings, no endpoint: nothing to write to
        assert _exporters(provider) == []
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("root") as root:
            with tracer.start_as_current_span("child") as child:
                pass
        assert root.get_span_context().is_valid
        assert child.get_span_context().trace_id == root.get_span_context().trace_id
        assert provider.force_flush()
    assert not (tmp_path / "traces.sqlite").exists() and not list(tmp_path.iterdir())


def test_untraced_requests_are_reads_that_continue_no_trace():
    tp = (b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")
    assert untraced_request({"type": "http", "method": "GET", "headers": [(b"accept", b"*/*")]})
    assert untraced_request({"type": "http", "method": "HEAD", "headers": []})
    assert not untraced_request({"type": "http", "method": "GET", "headers": [tp]})
    assert not untraced_request({"type": "http", "method": "POST", "headers": []})
    assert not untraced_request({"type": "websocket", "headers": []})
