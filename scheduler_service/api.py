"""The scheduler's FastAPI app; built by :func:`create_app`, never at import time."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from scheduler_service.config import SchedulerSettings
from scheduler_service.routes import dashboard, domains, evals, metrics, monitor, status, system, tasks
from scheduler_service.state import SchedulerState
from shared.http import install_validation_handler
from shared.telemetry import HTTP_TELEMETRY


def create_app(config: SchedulerSettings, state: SchedulerState) -> FastAPI:
    """The REST API over ``state``; its lifespan starts the producer and sampler and stops them.

    Routes: ``POST/GET /v1/tasks``, ``POST/GET /v1/evals``, ``GET/PUT/PATCH /v1/domains[/{domain}]``
    (and ``POST .../pause``, ``.../resume``, ``.../breaker/{open,close}``), ``GET /v1/alerts``,
    ``GET /v1/monitor``, ``POST /v1/control``, ``POST /v1/training/{pause,resume}``, ``GET /v1/status``,
    ``GET /v1/metrics/history``, ``GET /healthz``, ``GET /metrics`` (Prometheus); the live page
    ``GET /dashboard`` and its JSON ``GET /v1/dashboard/{data,trace/{group_id}}``; OpenAPI docs at ``/docs``.
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
    for r in (tasks.router, evals.router, domains.router, monitor.router, status.router, dashboard.router,
              metrics.router, system.router):
        app.include_router(r)
    install_validation_handler(app)
    return app
