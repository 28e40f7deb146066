"""``flywheel alerts`` and ``flywheel control`` against a real scheduler app (no Kafka) served by uvicorn on a
free port in a thread, and ``control --kafka`` against the session broker."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time

import httpx
import orjson
import pytest
from typer.testing import CliRunner

from flywheel.broker import free_port
from flywheel.cli import app
from flywheel.config import FlywheelConfig
from scheduler_service.api import create_app
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared import topics
from shared.auth import auth_headers, token_from_run_dir
from shared.config import RunConfig
from shared.schemas import Control


@pytest.fixture
def scheduler_url(tmp_path, monkeypatch):
    """A scheduler (REST only, registry in ``tmp_path``) with one task of domain ``toy``, on a free port. Its
    token (written to ``tmp_path/auth_token`` when the scheduler checks tokens) is in ``$FLYWHEEL_AUTH__TOKEN``
    for the CLI."""
    import uvicorn

    cfg = FlywheelConfig(run=RunConfig(dir=str(tmp_path)))
    registry = Registry.from_url(cfg.scheduler.database_url, cfg.run)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, SchedulerState(cfg, registry, kafka=False)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the scheduler did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    token = token_from_run_dir(tmp_path)
    if token:
        monkeypatch.setenv("FLYWHEEL_AUTH__TOKEN", token)
    task = {"domain": "toy", "prompt": [{"role": "user", "content": "say a"}],
            "verifier": {"kind": "regex", "pattern": "^a"}, "samples_per_task": 2}
    assert httpx.post(f"{url}/v1/tasks", json={"tasks": [task]}, headers=auth_headers(token),
                      timeout=30).status_code == 202
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        registry.close()
    assert not thread.is_alive()


def cli(*args: str):
    """Run ``flywheel <args>``; the result (exit code, output)."""
    return CliRunner().invoke(app, list(args))


def test_a_table_printed_to_no_terminal_keeps_whole_cells():
    """Rich fits a table into 80 columns when stdout is no terminal and cuts every cell short; the CLI's tables
    take up to NON_TERMINAL_WIDTH there, so a long domain name survives ``flywheel domains | grep``."""
    from rich.table import Table

    from flywheel.cli.common import print_table

    table = Table("domain", "status", "weight", "share", "level", "pass", "train/eval", "retired", "flagged")
    name = "reasoning_gym_basic_arithmetic_with_a_long_name"
    table.add_row(name, "active", "1", "0.500", "easy (1/3)", "0.25", "128/64", "3", "0")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_table(table)
    assert name in buf.getvalue() and "train/eval" in buf.getvalue(), buf.getvalue()


def test_an_opened_breaker_is_listed_active_then_resolved_when_closed(scheduler_url):
    r = cli("control", "open_breaker", "--domain", "toy", "--reason", "inspecting", "--url", scheduler_url)
    assert r.exit_code == 0, r.output
    assert orjson.loads(r.output) == {"command": "open_breaker", "domain": "toy", "applied": True}

    r = cli("alerts", "--json", "--url", scheduler_url)
    assert r.exit_code == 0, r.output
    reply = orjson.loads(r.output)
    (br,) = [a for a in reply["active"] if a["key"] == "toy/breaker"]
    assert br["severity"] == "critical" and br["status"] == "firing" and br["details"]["manual"] is True
    assert "inspecting" in br["message"] and any(a["key"] == "toy/breaker" for a in reply["recent"])

    table = cli("alerts", "--url", scheduler_url)
    assert table.exit_code == 0 and "toy/breaker" in table.output and "active" in table.output, table.output

    r = cli("control", "close_breaker", "--domain", "toy", "--url", scheduler_url)
    assert r.exit_code == 0 and orjson.loads(r.output)["applied"] is True, r.output
    r = cli("alerts", "--active", "--json", "--url", scheduler_url)
    assert orjson.loads(r.output) == {"active": []}
    r = cli("alerts", "--json", "--domain", "toy", "--severity", "info", "--url", scheduler_url)
    assert [(a["key"], a["status"]) for a in orjson.loads(r.output)["recent"]] == [("toy/breaker", "resolved")]


def test_a_refused_command_prints_the_field_and_exits_1(scheduler_url):
    r = cli("control", "set_threshold", "--signal", "nope", "--threshold", '{"x":1}', "--url", scheduler_url)
    assert r.exit_code == 1 and "422" in r.output and "threshold" in r.output and "nope" in r.output, r.output
    r = cli("control", "open_breaker", "--url", scheduler_url)
    assert r.exit_code == 1 and "domain" in r.output, r.output
    r = cli("control", "open_breaker", "--domain", "elsewhere", "--url", scheduler_url)
    assert r.exit_code == 1 and "404" in r.output and "elsewhere" in r.output, r.output
    r = cli("alerts", "--severity", "loud", "--url", scheduler_url)
    assert r.exit_code == 1 and "severity" in r.output, r.output
    r = cli("control", "set_threshold", "--signal", "hack_rate", "--threshold", "{nope", "--url", scheduler_url)
    assert r.exit_code == 2 and "--threshold" in r.output, r.output
    r = cli("control", "domain_state", "--domain", "toy", "--url", scheduler_url)  # the scheduler's own
    assert r.exit_code == 2 and "COMMAND" in r.output, r.output

    r = cli("control", "set_threshold", "--signal", "hack_rate", "--threshold", '{"critical": 0.9}',
            "--url", scheduler_url)
    assert r.exit_code == 0 and orjson.loads(r.output)["thresholds"]["critical"] == 0.9, r.output


def test_an_unreachable_scheduler_exits_1_after_retrying():
    url = f"http://127.0.0.1:{free_port()}"
    for args in (("alerts",), ("control", "pause_training")):
        t0 = time.monotonic()
        r = cli(*args, "--url", url, "--retry", "1")
        assert r.exit_code == 1 and "scheduler unreachable" in r.output, r.output
        assert "attempts" in r.output and "ConnectError" in r.output and time.monotonic() - t0 >= 1.0, r.output


def test_the_token_comes_from_the_run_dir_and_a_401_says_where_it_comes_from(scheduler_url, tmp_path,
                                                                             monkeypatch):
    if not (tmp_path / "auth_token").exists():
        pytest.skip("this scheduler checks no token")
    monkeypatch.delenv("FLYWHEEL_AUTH__TOKEN", raising=False)
    monkeypatch.delenv("FLYWHEEL_AUTH__TOKEN_FILE", raising=False)
    r = cli("control", "open_breaker", "--domain", "toy", "--url", scheduler_url, "--run-dir", str(tmp_path))
    assert r.exit_code == 0 and orjson.loads(r.output)["applied"] is True, r.output  # <run dir>/auth_token
    r = cli("control", "close_breaker", "--domain", "toy", "--url", scheduler_url)  # no token anywhere
    assert r.exit_code == 1 and "401" in r.output and "no token was sent" in r.output, r.output
    assert "FLYWHEEL_AUTH__TOKEN" in r.output and "FLYWHEEL_AUTH__TOKEN_FILE" in r.output
    assert "auth_token" in r.output


def test_a_kafka_command_is_checked_before_it_is_sent():
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens: only what is refused before sending gets an answer
    r = cli("control", "set_threshold", "--signal", "nope", "--threshold", '{"x":1}', "--kafka", bootstrap)
    assert r.exit_code == 1 and "threshold" in r.output and "nope" in r.output, r.output
    r = cli("control", "close_breaker", "--kafka", bootstrap)
    assert r.exit_code == 1 and "domain" in r.output, r.output
    r = cli("control", "close_breaker", "--domain", "toy", "--kafka", bootstrap)
    assert r.exit_code == 1 and "could not publish" in r.output, r.output


@pytest.mark.kafka
def test_control_over_kafka_publishes_a_cli_record(kafka_cfg, read_topic, unique):
    from shared.kafka import ensure_topics

    asyncio.run(ensure_topics(kafka_cfg, [topics.CONTROL]))  # a running system's scheduler made it
    r = cli("control", "open_breaker", "--domain", f"toy-{unique}", "--reason", "no REST",
            "--kafka", kafka_cfg.bootstrap_servers)
    assert r.exit_code == 0, r.output
    sent = orjson.loads(r.output)
    assert sent["origin"] == "cli" and sent["key"] == f"toy-{unique}"
    got = asyncio.run(read_topic(kafka_cfg, topics.CONTROL, Control, 1, timeout_s=20,
                                 keep=lambda c: c.control_id == sent["control_id"]))
    assert [(c.command, c.domain, c.origin, c.reason) for c in got] == [("open_breaker", f"toy-{unique}", "cli",
                                                                         "no REST")]
