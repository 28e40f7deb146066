"""HTTP API of the sandbox service.

- ``POST /v1/execute``: body :class:`~sandbox_service.schemas.ExecuteRequest`, answer
  :class:`~sandbox_service.schemas.ExecuteResult` with HTTP 200 for every run, including runs whose
  environment failed on every attempt (status ``infra_error``). HTTP 422: the body is invalid (the
  detail names the field). HTTP 400: the body is not JSON (invalid UTF-8 or JSON, nested too deep; the
  detail says where). HTTP 401: the bearer token is missing or wrong (``shared.auth``; when the app has
  one). HTTP 413: the body is larger than ``max_request_bytes``. HTTP 503: the
  service cannot take work now (queue full, circuit breaker
  open, shutting down); retry later. Callers must treat ``infra_error`` and 503 as infrastructure
  failures, never as a wrong answer.
- ``GET /healthz``: isolation layers, degraded layers, workers, breaker, run counts. HTTP 200 while
  the service takes work, 503 while the breaker is open or no worker is alive.
- ``GET /metrics``: Prometheus text (:mod:`sandbox_service.metrics`: runs by status, latency by language,
  attempts, environment failures, busy and idle slots, the breaker, open sessions and session latencies).
- Workspaces and sessions (``/v1/workspaces/{digest}``, ``/v1/sessions``...): :mod:`sandbox_service.sessions_api`.

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
from sandbox_service.metrics import session_metrics
from sandbox_service.sessions import SessionStore
from sandbox_service.sessions_api import add_session_routes
from shared.auth import AUTH, AUTH_RESPONSES
from shared.http import BodyLimit, CheckedRoute, install_validation_handler
from shared.metrics import render
from shared.telemetry import HTTP_TELEMETRY, setup_tracing

log = logging.getLogger("sandbox.api")


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


def _session_store(config: SandboxConfig, pool: Pool, found: Capabilities) -> SessionStore:
    """The sessions of this service (not started), its families on the pool's metrics registry."""
    store = SessionStore(config, "namespaces" in pool.layers,
                         "sessions need the 'namespaces' isolation layer (overlay mounts): "
                         + found.problems.get("namespaces", "switched off by sandbox.disable_layers"))
    ops = session_metrics(pool.metrics.registry, lambda: (len(store.sessions), len(store.templates), store.counters))
    store.op_seconds = lambda op, seconds: ops.labels(op).observe(seconds)
    return store


def create_app(config: SandboxConfig, caps: Capabilities | None = None, auth_token: str | None = None) -> FastAPI:
    """Build the sandbox app; the isolation probe and the worker pool start in its lifespan.

    Args:
        config: service settings.
        caps: a probe result to use instead of probing (tests).
        auth_token: the bearer token ``POST /v1/execute`` requires (HTTP 401 without it;
            ``sandbox_service.main`` passes ``shared.auth.server_token(settings.auth, settings.run)``);
            ``None``: no check (in-process tests).

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
        store = app.state.sessions = _session_store(config, pool, found)
        try:
            store.start()  # its tmpfs before the workers: their mount namespaces are copies made when they start
            await pool.start()
            log.info("sandbox ready: layers=%s degraded=%s workers=%d cgroup=%s landlock_abi=%d",
                     pool.layers, degraded, config.max_concurrency, found.cgroup, found.landlock_abi)
            if degraded:
                log.warning("sandbox runs DEGRADED without: %s", ", ".join(degraded))
            yield
        finally:
            await pool.close()
            await store.close()

    app = FastAPI(title="Flywheel sandbox", lifespan=lifespan, telemetry=HTTP_TELEMETRY)
    app.router.route_class = CheckedRoute
    app.state.auth_token = auth_token
    install_validation_handler(app)

    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        h = app.state.pool.health()
        h["sessions"] = app.state.sessions.health()
        return JSONResponse(h, status_code=200 if h["status"] != "unavailable" else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        # async: the pool's state is read on the event loop, where the executions change it
        body, content_type = render(app.state.pool.metrics.registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.post("/v1/execute", response_model=ExecuteResult, dependencies=AUTH,
              responses={200: {"model": ExecuteResult}, **AUTH_RESPONSES,
                         400: {"description": "The body is not JSON (invalid UTF-8 or JSON, nested too deep)."},
                         413: {"description": "The body is larger than sandbox.max_request_bytes."},
                         503: {"description": "Queue full, circuit breaker open or shutting down: retry later."}})
    async def execute(req: ExecuteRequest, request: Request) -> Response:
        try:
            app.state.pool.admit()
        except Overloaded as e:
            raise HTTPException(503, str(e)) from None
        return await run_logged(req, request, None)

    async def run_logged(req: ExecuteRequest, request: Request, session: dict | None) -> Response:
        return await _run_logged(app.state.pool, tracer, req, request, session)

    add_session_routes(app, lambda: app.state.sessions, lambda: app.state.pool, run_logged)
    return app


async def _run_logged(pool: Pool, tracer, req: ExecuteRequest, request: Request, session: dict | None) -> Response:
    """Run ``req`` (admitted already; on ``session``'s workspace when given) in a span, log one line, answer."""
    ctx = propagate.extract(dict(request.headers))
    run_id = uuid.uuid4().hex
    with tracer.start_as_current_span("sandbox.execute", context=ctx) as span:
        span.set_attribute("sandbox.run_id", run_id)
        span.set_attribute("sandbox.language", req.language)
        result = await pool.execute(req, run_id, session)
        span.set_attribute("sandbox.status", result.status)
        trace_id = span.get_span_context().trace_id
        log.info("run run_id=%s trace_id=%032x language=%s status=%s exit_code=%s attempts=%d wall_s=%.4f "
                 "cpu_s=%s peak_memory_bytes=%s tests=%s/%s stdout_bytes=%d stderr_bytes=%d degraded=%s "
                 "session=%s", run_id, trace_id, req.language, result.status, result.exit_code, result.attempts,
                 result.wall_s, result.cpu_s, result.peak_memory_bytes, result.tests_passed,
                 result.tests_total, len(result.stdout), len(result.stderr), ",".join(result.degraded) or "-",
                 session["dir"].rsplit("/", 1)[-1] if session else "-")
    # already validated when built: serialise once (orjson), not again through the response model
    return Response(orjson.dumps(result.model_dump()), media_type="application/json")
