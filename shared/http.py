"""HTTP helpers shared by the services' FastAPI apps."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response


def install_validation_handler(app: FastAPI) -> None:
    """Answer request validation errors with 422 and ASCII-escaped JSON.

    FastAPI's own handler echoes the offending input as UTF-8 and fails with a 500 when that input
    holds a lone surrogate (``"\\ud800"`` is valid JSON but not UTF-8 text); escaped JSON carries any string.
    """

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        body = json.dumps({"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True)
        return Response(body, status_code=422, media_type="application/json")
