"""The scheduler's FastAPI app; built by :func:`create_app`, never at import time."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI

from scheduler_service.config import SchedulerSettings
from scheduler_service.routes import dashboard, domains, evals, metrics, monitor, status, system, tasks
from scheduler_service.state import SchedulerState
from shared.auth import server_token
from shared.http import BodyLimit, install_validation_handler
from shared.telemetry import HTTP_TELEMETRY


def create_app(config: SchedulerSettings, state: SchedulerState) -> FastAPI:
    """The REST API over ``state``; its lifespan starts the producer and sampler and stops them.

    Routes: ``POST/GET /v1/tasks``, ``POST/GET /v1/evals``, ``GET/PUT/PATCH /v1/domains[/{domain}]``
    (and ``POST .../pause``, ``.../resume``, ``.../breaker/{open,close}``), ``GET /v1/alerts``,
    ``GET /v1/monitor``, ``POST /v1/control``, ``POST /v1/training/{pause,resume}``, ``GET /v1/status``,
    ``GET /v1/metrics/history``, ``GET /healthz``, ``GET /metrics`` (Prometheus); the live page
    ``GET /dashboard`` and its JSON ``GET /v1/dashboard/{data,trace/{group_id}}``; OpenAPI docs at ``/docs``.

    Every mutating route (POST, PUT, PATCH, DELETE) needs ``Authorization: Bearer <token>`` (HTTP 401
    otherwise; ``shared.auth``): the token is ``shared.auth.server_token(config.auth, config.run)``, read
    once here (a new one is written to the token file when none exists; ``auth.required: false``: no
    check). Reads stay open. Bodies over ``scheduler.max_body_bytes`` get 413 before they are read.

    Raises:
        shared.auth.TokenError: the token file cannot be read or written.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Flywheel scheduler", version="0.1.0", lifespan=lifespan, telemetry=HTTP_TELEMETRY)
    app.state.scheduler = state
    app.state.config = config
    app.state.auth_token = server_token(config.auth, config.run)
    for r in (tasks.router, evals.router, domains.router, monitor.router, status.router, dashboard.router,
              metrics.router, system.router):
        app.include_router(r)
    install_validation_handler(app)
    app.add_middleware(WakeSampler, state=state)
    app.add_middleware(BodyLimit, max_bytes=config.scheduler.max_body_bytes)
    _add_components(app, tasks.openapi_components())
    return app


class WakeSampler:
    """ASGI middleware: a mutating request (new tasks, an eval round, a domain change, a control) may give the
    sampler work, so its issue loop is woken once the request is answered rather than at its next timed pass.
    Plain ASGI (not ``BaseHTTPMiddleware``), so request bodies stream through untouched (``BodyLimit``)."""

    def __init__(self, app, state: SchedulerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS") \
                    and self.state.sampler is not None:
                self.state.sampler.wake()


def _add_components(app: FastAPI, schemas: dict[str, Any]) -> None:
    """Add ``schemas`` to the OpenAPI document's ``components.schemas`` (bodies a route reads itself, e.g.
    ``POST /v1/tasks``'s, validated off the event loop); FastAPI's own components win a name clash."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = base()
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in schemas.items():
                comps.setdefault(name, schema)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
