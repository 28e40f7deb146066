"""HTTP API of the sandbox service.

- ``POST /v1/execute``: body :class:`~sandbox_service.schemas.ExecuteRequest`, answer
  :class:`~sandbox_service.schemas.ExecuteResult` with HTTP 200 for every run, including failures of
  the service itself for that run (status ``infra_error``). HTTP 422: the body is invalid (the
  detail names the field). HTTP 503: the service is overloaded (more than ``max_queued`` requests
  already wait for one of ``max_concurrency`` slots) or shutting down; retry later. Callers must
  treat both ``infra_error`` and 503 as infrastructure failures, never as a wrong answer.
- ``GET /healthz``: ``{"status": "ok", "network_isolated": bool, "runs": {status: count}, ...}``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import get_args

from fastapi import FastAPI, HTTPException

from sandbox_service import executor
from sandbox_service.config import SandboxConfig
from sandbox_service.schemas import ExecuteRequest, ExecuteResult, Status
from shared.http import install_validation_handler

log = logging.getLogger("sandbox.api")


class _State:
    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.semaphore = asyncio.Semaphore(config.max_concurrency)
        self.waiting = 0
        self.running = 0
        self.network_isolated: bool | None = None
        self.runs: dict[str, int] = {s: 0 for s in get_args(Status)}
        self.closing = False

    async def isolation(self) -> bool:
        if self.network_isolated is None:
            self.network_isolated = await executor.probe_network_isolation(self.config)
        return self.network_isolated


def create_app(config: SandboxConfig) -> FastAPI:
    """Build the sandbox app for ``config``.

    The network-isolation probe runs at start-up (lifespan) or at the first request.

    Raises:
        RuntimeError: at start-up, when ``config.require_network_isolation`` is set and the probe fails.
    """
    state = _State(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        isolated = await state.isolation()
        if not isolated and config.require_network_isolation:
            raise RuntimeError("sandbox: network isolation required but `unshare --net` does not work here")
        log.info("sandbox ready: network_isolated=%s max_concurrency=%d", isolated, config.max_concurrency)
        try:
            yield
        finally:
            state.closing = True
            executor.kill_all_active()

    app = FastAPI(title="Flywheel sandbox", lifespan=lifespan)
    app.state.sandbox = state
    install_validation_handler(app)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {
            "status": "ok",
            "network_isolated": await state.isolation(),
            "runs": dict(state.runs),
            "running": state.running,
            "waiting": state.waiting,
        }

    @app.post("/v1/execute", response_model=ExecuteResult)
    async def execute(req: ExecuteRequest) -> ExecuteResult:
        isolated = await state.isolation()
        if not isolated and config.require_network_isolation:
            raise HTTPException(503, "network isolation required but unavailable")
        if state.closing:
            raise HTTPException(503, "sandbox is shutting down")
        if state.semaphore.locked() and state.waiting >= config.max_queued:
            raise HTTPException(503, f"sandbox overloaded: {state.waiting} requests already waiting")
        state.waiting += 1
        try:
            await state.semaphore.acquire()
        finally:
            state.waiting -= 1
        state.running += 1
        try:
            result = await executor.execute(req, config, network_isolated=isolated)
        except Exception as e:  # a bug in the service, never the program's fault
            log.exception("sandbox: execution failed")
            result = ExecuteResult(run_id="-", status="infra_error", exit_code=None, stdout="",
                                   stderr=f"sandbox: internal error: {e!r}", wall_s=0.0,
                                   network_isolated=isolated, degraded=[] if isolated else ["network"])
        finally:
            state.running -= 1
            state.semaphore.release()
        state.runs[result.status] += 1
        log.info("run run_id=%s status=%s exit_code=%s wall_s=%.3f stdout_bytes=%d stderr_bytes=%d",
                 result.run_id, result.status, result.exit_code, result.wall_s,
                 len(result.stdout), len(result.stderr))
        return result

    return app
