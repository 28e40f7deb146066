"""The scheduler's FastAPI app; built by :func:`create_app`, never at import time."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from shared.config import FlywheelConfig

from scheduler_service.routes import evals, status, tasks
from scheduler_service.state import SchedulerState


def create_app(config: FlywheelConfig, state: SchedulerState) -> FastAPI:
    """The REST API over ``state``; its lifespan starts the producer and sampler and stops them.

    Routes: ``POST/GET /v1/tasks``, ``POST/GET /v1/evals``, ``GET /v1/status``,
    ``GET /v1/metrics/history``, ``GET /healthz``; OpenAPI docs at ``/docs``.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Flywheel scheduler", version="0.1.0", lifespan=lifespan)
    app.state.scheduler = state
    app.state.config = config
    for r in (tasks.router, evals.router, status.router):
        app.include_router(r)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own handler echoes the input as UTF-8 and fails (500) on a lone surrogate;
        # ASCII-escaped JSON carries any string
        body = json.dumps({"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True)
        return Response(body, status_code=422, media_type="application/json")

    return app
