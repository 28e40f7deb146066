"""HTTP API of the sandbox service.

- ``POST /v1/execute``: body :class:`~sandbox_service.schemas.ExecuteRequest`, answer
  :class:`~sandbox_service.schemas.ExecuteResult` with HTTP 200 for every run, including runs whose
  environment failed on every attempt (status ``infra_error``). HTTP 422: the body is invalid (the
  detail names the field). HTTP 413: the body is larger than ``max_request_bytes``. HTTP 503: the
  service cannot take work now (queue full, circuit breaker
  open, shutting down); retry later. Callers must treat ``infra_error`` and 503 as infrastructure
  failures, never as a wrong answer.
- ``GET /healthz``: isolation layers, degraded layers, workers, breaker, run counts. HTTP 200 while
  the service takes work, 503 while the breaker is open or no worker is alive.
- ``GET /metrics``: Prometheus text (:mod:`sandbox_service.metrics`: runs by status, latency by language,
  attempts, environment failures, busy and idle slots, the breaker).

Every execution is logged as one structured line with its run id and the W3C trace id from the
request's ``traceparent`` header.
"""

from __future__ import annotations

import logging
import uuid

import orjson
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate

from sandbox_service.config import SandboxConfig
from sandbox_service.isolation import Capabilities, probe
from sandbox_service.pool import Overloaded, Pool
from sandbox_service.schemas import ExecuteRequest, ExecuteResult
from shared.http import install_validation_handler
from shared.metrics import render
from shared.telemetry import HTTP_TELEMETRY, setup_tracing

log = logging.getLogger("sandbox.api")


class BodyLimit:
    """Pure ASGI middleware: HTTP 413 for a body declared larger than ``max_bytes`` and 411 for a POST
    without Content-Length, before any of the body is read. (Starlette's ``BaseHTTPMiddleware`` would
    cost a task group per request, a measurable share of a sandbox execution.)"""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            problem = None
            if length is None:
                if scope["method"] == "POST":
                    problem = (411, "a Content-Length header is required")
            elif not length.isdigit() or int(length) > self.max_bytes:
                problem = (413, f"request body larger than {self.max_bytes} bytes")
            if problem is not None:
                await JSONResponse({"detail": problem[1]}, status_code=problem[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_isolation(config: SandboxConfig, caps: Capabilities) -> list[str]:
    """The layers this service will run without (missing on the host or switched off), sorted.

    Raises:
        RuntimeError: some layer is missing and ``config.allow_degraded`` is off; the message names
            each missing layer and why.
    """
    missing = dict(caps.problems)
    for layer in config.disable_layers:
        missing.setdefault(layer, "switched off by sandbox.disable_layers")
    if config.uid_base is None:
        missing.setdefault("uid", "sandbox.uid_base is unset: code would run as the service's uid")
    if missing and not config.allow_degraded:
        reasons = "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))
        raise RuntimeError(f"sandbox: refusing to start without full isolation ({reasons}). "
                           "Set sandbox.allow_degraded=true (FLYWHEEL_SANDBOX__ALLOW_DEGRADED=true) to run "
                           "degraded; every result will then name the missing layers.")
    return sorted(missing)


def create_app(config: SandboxConfig, caps: Capabilities | None = None) -> FastAPI:
    """Build the sandbox app; the isolation probe and the worker pool start in its lifespan.

    Args:
        config: service settings.
        caps: a probe result to use instead of probing (tests).

    Raises:
        RuntimeError: at start-up, when isolation is incomplete and not allowed to be
            (:func:`check_isolation`), or when no worker starts.
    """
    tracer = setup_tracing("sandbox")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        found = caps or probe()
        degraded = check_isolation(config, found)
        pool = Pool(config, found)
        app.state.pool = pool
        try:
            await pool.start()
            log.info("sandbox ready: layers=%s degraded=%s workers=%d cgroup=%s landlock_abi=%d",
                     pool.layers, degraded, config.max_concurrency, found.cgroup, found.landlock_abi)
            if degraded:
                log.warning("sandbox runs DEGRADED without: %s", ", ".join(degraded))
            yield
        finally:
            await pool.close()

    app = FastAPI(title="Flywheel sandbox", lifespan=lifespan, telemetry=HTTP_TELEMETRY)
    install_validation_handler(app)

    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        h = app.state.pool.health()
        return JSONResponse(h, status_code=200 if h["status"] != "unavailable" else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        # async: the pool's state is read on the event loop, where the executions change it
        body, content_type = render(app.state.pool.metrics.registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.post("/v1/execute", response_model=ExecuteResult, responses={200: {"model": ExecuteResult}})
    async def execute(req: ExecuteRequest, request: Request) -> Response:
        pool: Pool = app.state.pool
        try:
            pool.admit()
        except Overloaded as e:
            raise HTTPException(503, str(e)) from None
        ctx = propagate.extract(dict(request.headers))
        run_id = uuid.uuid4().hex
        with tracer.start_as_current_span("sandbox.execute", context=ctx) as span:
            span.set_attribute("sandbox.run_id", run_id)
            span.set_attribute("sandbox.language", req.language)
            result = await pool.execute(req, run_id)
            span.set_attribute("sandbox.status", result.status)
            trace_id = span.get_span_context().trace_id
            log.info("run run_id=%s trace_id=%032x language=%s status=%s exit_code=%s attempts=%d wall_s=%.4f "
                     "cpu_s=%s peak_memory_bytes=%s tests=%s/%s stdout_bytes=%d stderr_bytes=%d degraded=%s",
                     run_id, trace_id, req.language, result.status, result.exit_code, result.attempts,
                     result.wall_s, result.cpu_s, result.peak_memory_bytes, result.tests_passed,
                     result.tests_total, len(result.stdout), len(result.stderr), ",".join(result.degraded) or "-")
        # already validated when built: serialise once (orjson), not again through the response model
        return Response(orjson.dumps(result.model_dump()), media_type="application/json")

    return app
