"""The server stays responsive while runs are in flight, and max_concurrency (the number of warm workers) bounds parallel runs."""

from __future__ import annotations

import asyncio
import time

import httpx

from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig

SLEEP = "import time\ntime.sleep(1.0)\nprint('done')"


async def test_parallel_runs_and_responsive_healthz():
    app = create_app(SandboxConfig(max_concurrency=2))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=30) as c:
        await c.get("/healthz")  # probe once, outside the timing
        t0 = time.monotonic()
        runs = [asyncio.create_task(c.post("/v1/execute", json={"code": SLEEP})) for _ in range(2)]
        await asyncio.sleep(0.2)
        h0 = time.monotonic()
        health = (await c.get("/healthz")).json()
        assert time.monotonic() - h0 < 0.5  # not blocked behind the runs
        assert health["running"] == 2
        results = [r.json() for r in await asyncio.gather(*runs)]
        elapsed = time.monotonic() - t0
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert elapsed < 1.8  # the two ran side by side, not one after the other


async def test_concurrency_is_bounded():
    app = create_app(SandboxConfig(max_concurrency=1))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=30) as c:
        await c.get("/healthz")
        t0 = time.monotonic()
        results = await asyncio.gather(*[c.post("/v1/execute", json={"code": SLEEP}) for _ in range(2)])
        elapsed = time.monotonic() - t0
    assert [r.json()["status"] for r in results] == ["ok", "ok"]
    assert elapsed >= 2.0  # one slot: the second run waited for the first


async def test_queue_full_is_503():
    app = create_app(SandboxConfig(max_concurrency=1, max_queued=0))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=30) as c:
        await c.get("/healthz")
        first = asyncio.create_task(c.post("/v1/execute", json={"code": SLEEP}))
        await asyncio.sleep(0.2)
        second = await c.post("/v1/execute", json={"code": "print(1)"})
        assert second.status_code == 503
        assert (await first).json()["status"] == "ok"
