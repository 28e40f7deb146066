"""Environment failures: retried on a fresh worker, infra_error when they persist, a circuit breaker,
worker recycling, and the refusal to run with weaker isolation unless told to."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from fastapi.testclient import TestClient

from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig
from shared.metrics import CONTENT_TYPE_PLAIN, parse

SLOW = "import time\ntime.sleep(0.6)\nprint('done')"


def _kill_workers(app) -> int:
    n = 0
    for w in list(app.state.pool.workers.values()):
        if w.alive:
            os.killpg(w.proc.pid, signal.SIGKILL)
            n += 1
    return n


async def test_worker_killed_mid_run_is_retried_on_a_fresh_worker():
    app = create_app(SandboxConfig(max_concurrency=1))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=60) as c:
        first_pid = (await c.get("/healthz")).json()["workers"]["pids"]
        run = asyncio.create_task(c.post("/v1/execute", json={"code": SLOW}))
        await asyncio.sleep(0.3)
        assert _kill_workers(app) == 1
        res = (await run).json()
        assert (res["status"], res["stdout"], res["attempts"]) == ("ok", "done\n", 2), res
        health = (await c.get("/healthz")).json()
        assert health["counters"]["environment_failures"] == 1
        assert health["workers"]["pids"] != first_pid and health["status"] == "ok"


async def test_persistent_failure_is_infra_error_and_opens_the_breaker():
    cfg = SandboxConfig(max_concurrency=1, retries=2, breaker_window=1, breaker_failure_ratio=1.0,
                        breaker_cooldown_s=1.0)
    app = create_app(cfg)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=60) as c:
        stop = asyncio.Event()

        async def killer() -> None:  # every worker dies 0.2 s into whatever it runs
            while not stop.is_set():
                await asyncio.sleep(0.2)
                if app.state.pool.running:
                    _kill_workers(app)

        k = asyncio.create_task(killer())
        try:
            res = (await c.post("/v1/execute", json={"code": SLOW})).json()
        finally:
            stop.set()
            await k
        assert res["status"] == "infra_error" and res["attempts"] == 3, res
        assert "environment failed 3 times" in res["stderr"]
        health = await c.get("/healthz")
        assert health.status_code == 503 and health.json()["breaker"]["state"] == "open"
        refused = await c.post("/v1/execute", json={"code": "print(1)"})
        assert refused.status_code == 503 and "circuit breaker" in refused.text
        # after the cool-down the service runs a canary by itself (no request needed) and closes the breaker
        for _ in range(100):
            health = await c.get("/healthz")
            if health.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert health.status_code == 200 and health.json()["breaker"]["state"] == "closed", health.json()
        assert health.json()["counters"]["breaker_trials"] == 1
        res = (await c.post("/v1/execute", json={"code": "print(1)"})).json()
        assert res["status"] == "ok", res


def test_workers_are_recycled():
    with TestClient(create_app(SandboxConfig(max_concurrency=1, recycle_after_runs=2))) as c:
        pids = set()
        for i in range(5):
            res = c.post("/v1/execute", json={"code": f"print({i})"}).json()
            assert (res["status"], res["stdout"], res["attempts"]) == ("ok", f"{i}\n", 1), res
            pids.update(c.get("/healthz").json()["workers"]["pids"])
        health = c.get("/healthz").json()
        assert health["counters"]["workers_recycled"] >= 2
        assert len(pids) >= 2 and health["counters"].get("environment_failures", 0) == 0


def test_request_errors_are_not_environment_failures():
    """Files that do not fit the run's disk are the caller's fault: runtime_error at once, no retry, and
    the breaker does not move (the break-it pass opened it with such requests)."""
    with TestClient(create_app(SandboxConfig(max_concurrency=1, breaker_window=2))) as c:
        for _ in range(4):
            res = c.post("/v1/execute", json={"code": "print(1)", "disk_mb": 1, "files": {"big": "a" * 2_000_000}}).json()
            assert (res["status"], res["attempts"]) == ("runtime_error", 1), res
            assert "do not fit" in res["stderr"]
        health = c.get("/healthz").json()
        assert health["breaker"]["state"] == "closed" and health["counters"].get("environment_failures", 0) == 0
        r = c.post("/v1/execute", content=b"{}", headers={"content-type": "application/json",
                                                          "content-length": str(2**31)})
        assert r.status_code == 413


def test_large_stdin_needs_no_extra_process():
    """The second break-it pass: stdin over a pipe's 64 KiB used a feeder process that the process limit
    refused, an environment failure per attempt; now R feeds it."""
    with TestClient(create_app(SandboxConfig(max_concurrency=1))) as c:
        res = c.post("/v1/execute", json={"code": "import sys\nprint(len(sys.stdin.read()))", "stdin": "a" * 300_000,
                                          "max_processes": 1}).json()
        assert (res["status"], res["stdout"], res["attempts"]) == ("ok", "300000\n", 1), res


def test_killed_workers_leave_no_cgroups_or_scratch_behind():
    from pathlib import Path

    from sandbox_service.cgroups import slot_cgroup_names
    from sandbox_service.isolation import probe

    caps = probe()
    app = create_app(SandboxConfig(max_concurrency=1))
    with TestClient(app) as c:
        names = [w.name for w in app.state.pool.workers.values()]
        _kill_workers(app)
        res = c.post("/v1/execute", json={"code": "print(1)"}).json()
        assert res["status"] == "ok"
        import time as _t
        _t.sleep(0.5)
        live = {w.name for w in app.state.pool.workers.values()}
        assert not (set(names) & live)
        assert not (set(names) & set(slot_cgroup_names(caps.cgroup))) if caps.cgroup else True
        assert not any(Path("/tmp").glob(f"flywheel-sbx-{names[0]}-*"))
    own = str(os.getpid())
    assert not [n for n in (slot_cgroup_names(caps.cgroup) if caps.cgroup else []) if n.startswith(own + "-")]
    assert not list(Path("/tmp").glob(f"flywheel-sbx-{own}-*"))


def test_missing_layer_refuses_to_start_unless_degraded_is_allowed():
    with pytest.raises(RuntimeError, match="landlock: switched off"):
        with TestClient(create_app(SandboxConfig(disable_layers=["landlock"]))):
            pass
    with TestClient(create_app(SandboxConfig(disable_layers=["landlock"], allow_degraded=True))) as c:
        health = c.get("/healthz").json()
        assert health["status"] == "degraded" and health["degraded"] == ["landlock"]
        res = c.post("/v1/execute", json={"code": "print(1)"}).json()
        assert res["status"] == "ok" and res["degraded"] == ["landlock"]


def test_metrics_are_prometheus_text():
    with TestClient(create_app(SandboxConfig(max_concurrency=1))) as c:
        c.post("/v1/execute", json={"code": "print(1)"})
        c.post("/v1/execute", json={"code": "raise SystemExit(3)"})
        r = c.get("/metrics")
        assert r.headers["content-type"] == CONTENT_TYPE_PLAIN
        m = parse(r.text)
        runs = {lab["status"]: v for lab, v in m["flywheel_sandbox_runs_total"]}
        assert runs["ok"] == 1 and runs["runtime_error"] == 1 and runs["infra_error"] == 0
        assert m["flywheel_sandbox_execution_seconds_count"] == [({"language": "python"}, 2.0)]
        assert 0 < m["flywheel_sandbox_execution_seconds_sum"][0][1] < 60
        assert m["flywheel_sandbox_attempts_total"] == [({}, 2.0)]
        assert m["flywheel_sandbox_environment_failures_total"] == [({}, 0.0)]
        assert m["flywheel_sandbox_workers_started_total"][0][1] >= 1
        assert m["flywheel_sandbox_breaker_open"] == [({}, 0.0)]
        assert m["flywheel_sandbox_busy_slots"] == [({}, 0.0)] and m["flywheel_sandbox_idle_slots"] == [({}, 1.0)]
        assert m["flywheel_sandbox_workers_alive"] == [({}, 1.0)]
        assert m["flywheel_sandbox_workers_configured"] == [({}, 1.0)]


async def test_health_check_replaces_a_dead_idle_worker():
    app = create_app(SandboxConfig(max_concurrency=1, health_check_interval_s=0.3))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=60) as c:
        before = (await c.get("/healthz")).json()["workers"]["pids"]
        _kill_workers(app)  # idle, nobody is using it: only the health check can notice
        for _ in range(50):
            await asyncio.sleep(0.1)
            health = (await c.get("/healthz")).json()
            if health["counters"].get("health_check_failures") and health["workers"]["alive"] == 1:
                break
        assert health["counters"]["health_check_failures"] >= 1, health
        assert health["workers"]["pids"] != before and health["workers"]["alive"] == 1
        res = (await c.post("/v1/execute", json={"code": "print(1)"})).json()
        assert (res["status"], res["attempts"]) == ("ok", 1), res
