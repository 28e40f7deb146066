"""shared/client.py against a real uvicorn server in a subprocess (started late, killed -9 and restarted by
pid): retry through a restart, which requests are retried, the errors, the token. The policy's rules are
also checked on their own (pure)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel.broker import free_port
from shared.client import (SCHEDULER_IDEMPOTENT_POSTS, ApiClient, ApiStatusError, ApiUnreachable, AsyncApiClient,
                           RetryPolicy, Unauthorized, is_idempotent)

TOKEN = "t" * 32


# ------------------------------------------------------------------ the server (this file run as a script)

def _app(hits_file: Path):
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse

    from shared.auth import AUTH

    app = FastAPI()
    app.state.auth_token = TOKEN
    busy = {"left": 2}

    def hit(name: str) -> int:
        with open(hits_file, "a") as f:
            f.write(name + "\n")
        return sum(1 for line in hits_file.read_text().splitlines() if line == name)

    @app.get("/v1/pid")
    def pid() -> dict:
        return {"pid": os.getpid()}

    @app.post("/v1/once")
    def once() -> dict:
        return {"hits": hit("once"), "pid": os.getpid()}

    async def slow(name: str) -> dict:
        n = hit(name)
        await asyncio.sleep(2.0)
        return {"hits": n}

    @app.post("/v1/slow")
    async def post_slow() -> dict:
        return await slow("slow")

    @app.post("/v1/tasks")  # stands for the scheduler's idempotent POST
    async def post_tasks() -> dict:
        return await slow("tasks")

    @app.get("/v1/busy")
    def get_busy():
        if busy["left"] > 0:
            busy["left"] -= 1
            return JSONResponse({"detail": "queue full"}, status_code=503, headers={"Retry-After": "0.3"})
        return {"ok": True}

    @app.get("/v1/missing")
    def missing():
        hit("missing")
        raise HTTPException(404, detail="no such thing: x")

    @app.post("/v1/secret", dependencies=AUTH)
    def secret() -> dict:
        return {"ok": True}

    return app


if __name__ == "__main__":  # python test_client.py PORT DELAY_S HITS_FILE
    import uvicorn

    port, delay, hits = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    time.sleep(delay)
    uvicorn.run(_app(hits), host="127.0.0.1", port=port, log_level="warning")
    sys.exit(0)


# ------------------------------------------------------------------ fixtures

class Server:
    """Starts this file as a uvicorn server on ``port`` (after ``delay_s``); stops it by pid."""

    def __init__(self, tmp_path: Path) -> None:
        self.port, self.hits = free_port(), tmp_path / "hits.txt"
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def start(self, delay_s: float = 0.0, wait: bool = True) -> subprocess.Popen:
        root = Path(__file__).resolve().parents[2]
        p = subprocess.Popen([sys.executable, __file__, str(self.port), str(delay_s), str(self.hits)],
                             env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
        self.procs.append(p)
        if wait:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"{self.url}/v1/pid", timeout=1)
                    break
                except httpx.HTTPError:
                    assert p.poll() is None and time.monotonic() < deadline, "the test server did not start"
                    time.sleep(0.05)
        return p

    def hit_count(self, name: str) -> int:
        return sum(1 for line in self.hits.read_text().splitlines() if line == name) if self.hits.exists() else 0

    def kill(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    self.kill(p)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    try:
        yield s
    finally:
        s.stop()
    assert all(p.poll() is not None for p in s.procs)


# ------------------------------------------------------------------ through a restart

def test_a_get_and_a_post_ride_through_a_server_that_starts_late(server):
    server.start(delay_s=2.0, wait=False)  # nothing listens for ~2 s + the import time
    events = []
    t0 = time.monotonic()
    with ApiClient(server.url, retry=RetryPolicy(deadline_s=30), on_retry=events.append) as api:
        assert api.get("/v1/pid")["pid"] == server.procs[0].pid
        assert api.post("/v1/once")["hits"] == 1  # refused connections never reached it: sent once
    assert time.monotonic() - t0 >= 2.0 and len(events) >= 2
    assert all("ConnectError" in e.error for e in events) and events[-1].attempt == len(events)


def test_a_client_rides_through_a_kill_9_and_a_restart_on_the_same_port(server):
    first = server.start()
    with ApiClient(server.url, retry=RetryPolicy(deadline_s=30)) as api:
        assert api.get("/v1/pid")["pid"] == first.pid  # a pooled keep-alive connection to the first process
        server.kill(first)
        second = server.start(delay_s=1.0, wait=False)
        assert api.get("/v1/pid")["pid"] == second.pid
        assert api.post("/v1/once")["pid"] == second.pid


def test_a_server_down_past_the_deadline_raises_unreachable_naming_url_attempts_and_error(server):
    t0 = time.monotonic()
    with ApiClient(server.url, retry=RetryPolicy(deadline_s=1.5)) as api:
        with pytest.raises(ApiUnreachable) as e:
            api.get("/v1/pid")
    took = time.monotonic() - t0
    assert 1.4 <= took < 3.0, took
    msg = str(e.value)
    assert f"{server.url}/v1/pid" in msg and "ConnectError" in msg and e.value.attempts >= 3
    assert f"after {e.value.attempts} attempts" in msg
    assert isinstance(e.value, httpx.HTTPError)  # callers that caught httpx errors still do


# ------------------------------------------------------------------ what is retried

def test_a_post_is_not_retried_after_a_read_timeout_unless_its_route_is_idempotent(server):
    server.start()
    policy = RetryPolicy(deadline_s=4.0, idempotent_posts=SCHEDULER_IDEMPOTENT_POSTS)
    with ApiClient(server.url, timeout=0.5, retry=policy) as api:
        with pytest.raises(httpx.ReadTimeout):  # it reached the server: sending it again could do it twice
            api.post("/v1/slow")
        time.sleep(0.2)
        assert server.hit_count("slow") == 1
        with pytest.raises(ApiUnreachable) as e:  # POST /v1/tasks is idempotent: sent again until the deadline
            api.post("/v1/tasks")
    assert "ReadTimeout" in str(e.value) and e.value.attempts >= 3
    time.sleep(0.2)
    assert server.hit_count("tasks") == e.value.attempts


def test_503_is_retried_after_retry_after_and_4xx_is_not_retried_and_keeps_the_message(server):
    server.start()
    with ApiClient(server.url, retry=RetryPolicy(deadline_s=10)) as api:
        t0 = time.monotonic()
        assert api.get("/v1/busy") == {"ok": True}
        assert time.monotonic() - t0 >= 0.55  # two Retry-After: 0.3 pauses
        with pytest.raises(ApiStatusError) as e:
            api.get("/v1/missing")
    assert e.value.status_code == 404 and e.value.attempts == 1 and server.hit_count("missing") == 1
    assert "no such thing: x" in str(e.value) and "GET /v1/missing -> 404" in str(e.value)


def test_the_token_is_sent_and_a_401_says_where_the_token_comes_from(server):
    server.start()
    with ApiClient(server.url) as api:
        with pytest.raises(Unauthorized) as e:
            api.post("/v1/secret")
    msg = str(e.value)
    assert "401" in msg and "no token was sent" in msg
    assert "FLYWHEEL_AUTH__TOKEN" in msg and "FLYWHEEL_AUTH__TOKEN_FILE" in msg and "auth_token" in msg
    with ApiClient(server.url, token="wrong-" * 4) as api:
        with pytest.raises(Unauthorized, match="a token was sent but refused"):
            api.post("/v1/secret")
    with ApiClient(server.url, token=lambda: TOKEN) as api:  # read per request
        assert api.post("/v1/secret") == {"ok": True}


def test_the_async_client_rides_through_a_late_server_and_sends_the_token(server):
    server.start(delay_s=1.5, wait=False)

    async def go():
        api = AsyncApiClient(server.url, token=TOKEN, retry=RetryPolicy(deadline_s=30))
        try:
            r = await api.request("POST", "/v1/secret")
            return r.json()
        finally:
            await api.aclose()

    assert asyncio.run(go()) == {"ok": True}


# ------------------------------------------------------------------ the rules, pure

@pytest.mark.parametrize("method, path, error, status, want", [
    ("POST", "/v1/evals", httpx.ConnectError("refused"), None, "retry"),   # never sent
    ("POST", "/v1/evals", httpx.ReadTimeout("slow"), None, "fail"),        # maybe acted
    ("POST", "/v1/tasks", httpx.ReadTimeout("slow"), None, "retry"),       # idempotent route
    ("GET", "/v1/status", httpx.RemoteProtocolError("closed"), None, "retry"),
    ("PUT", "/v1/domains/a", httpx.ReadError("reset"), None, "retry"),
    ("POST", "/v1/execute", None, 503, "retry"),                           # refused without acting
    ("POST", "/v1/execute", None, 429, "retry"),
    ("POST", "/v1/execute", None, 502, "done"),                            # a gateway: maybe acted
    ("GET", "/v1/status", None, 504, "retry"),
    ("GET", "/v1/status", None, 500, "done"),
    ("GET", "/v1/status", None, 404, "done"),
    ("GET", "/v1/status", httpx.UnsupportedProtocol("ftp"), None, "fail"),
])
def test_the_retry_rule(method, path, error, status, want):
    policy = RetryPolicy(idempotent_posts=SCHEDULER_IDEMPOTENT_POSTS)
    assert policy.verdict(method, path, error=error, status=status) == want


def test_pauses_double_up_to_the_cap_with_jitter_and_idempotence_is_by_method_or_route():
    import random

    p = RetryPolicy(first_backoff_s=0.2, max_backoff_s=5.0, jitter=0.5)
    rng = random.Random(0)
    for n, top in [(1, 0.2), (2, 0.4), (3, 0.8), (6, 5.0), (40, 5.0)]:
        got = [p.pause_s(n, rng) for _ in range(50)]
        assert all(top / 2 <= g <= top for g in got) and max(got) - min(got) > 0
    assert is_idempotent("get", "/x") and is_idempotent("PUT", "/x") and not is_idempotent("POST", "/v1/tasks")
    assert is_idempotent("POST", "/v1/tasks/", SCHEDULER_IDEMPOTENT_POSTS)
    with pytest.raises(ValueError):
        RetryPolicy(deadline_s=-1)
