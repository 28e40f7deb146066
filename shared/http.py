"""HTTP helpers shared by the services' FastAPI apps (the scheduler and the sandbox).

- :class:`BodyLimit`: HTTP 413 for a request body over a size limit, before it is read (declared
  ``Content-Length``) or as soon as the received bytes pass it (chunked bodies without one).
- :func:`parse_json_body`: a request body as JSON, or a :class:`BodyError` (400) that says what is
  wrong and where: invalid UTF-8 (byte offset), invalid JSON (line, column), nesting too deep (path).
- :class:`CheckedRoute`: the route class of both apps: parses JSON bodies with :func:`parse_json_body`
  and turns an unexpected exception raised while a request is validated (before the endpoint runs)
  into a 422; an exception raised by the endpoint itself stays a 500 (a server bug, logged).
- :func:`install_validation_handler`: 422 bodies in ASCII-escaped JSON whose echoed input is cut to
  :data:`EXCERPT_CHARS` characters, and the 400 of :class:`BodyError`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("flywheel.http")

EXCERPT_CHARS = 200
"""Longest excerpt of the client's input a 4xx body echoes (characters); the rest is replaced by a count."""
MSG_CHARS = 1000
"""Longest error message a 4xx body carries (characters)."""
MAX_BODY_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in a JSON request body. The deepest legitimate body:
``tasks[i].metadata`` holds up to 32 levels (``shared.jsoncheck.MAX_JSON_DEPTH``) under 3."""


# ---------------------------------------------------------------- body size


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` when a body without ``Content-Length`` passes the limit (HTTP 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_bytes} bytes")


class BodyLimit:
    """Pure ASGI middleware: HTTP 413 for a body larger than ``max_bytes``.

    A declared ``Content-Length`` over the limit is refused before any byte is read (a malformed one
    gets 400); a body sent without it (chunked) is counted while it is received and refused as soon as it
    passes the limit, so no more than ``max_bytes`` plus one chunk is ever held. Pure ASGI rather than
    Starlette's ``BaseHTTPMiddleware``, which costs a task group per request.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _json_response(send, 400, "malformed Content-Length header")
                return
            if int(length) > self.max_bytes:
                await _json_response(send, 413, f"request body larger than {self.max_bytes} bytes")
                return
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as e:  # raised outside a route's exception handling (e.g. by another middleware)
            if started:
                raise
            await _json_response(send, 413, e.detail)


async def _json_response(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- JSON bodies


class BodyError(Exception):
    """A request body that is not JSON the API can read: ``status`` (400), ``detail`` (what and where)."""

    def __init__(self, detail: str, status: int = 400) -> None:
        super().__init__(detail)
        self.detail, self.status = detail, status


def _too_deep(value: Any, limit: int) -> str | None:
    """JSON path (``$.tasks[0].metadata.a``) of the first array or object nested deeper than ``limit``."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "$")]
    while stack:
        v, d, path = stack.pop()
        if isinstance(v, dict):
            if d > limit:
                return path
            stack.extend((c, d + 1, f"{path}.{k}") for k, c in v.items())
        elif isinstance(v, list):
            if d > limit:
                return path
            stack.extend((c, d + 1, f"{path}[{i}]") for i, c in enumerate(v))
    return None


def parse_json_body(raw: bytes, max_depth: int = MAX_BODY_DEPTH) -> Any:
    """``raw`` parsed as JSON (stdlib ``json``: a lone surrogate escape such as ``"\\ud800"`` parses and is
    refused later by the models, naming the field).

    Raises:
        BodyError: 400 for invalid UTF-8 (the byte offset), invalid JSON (line and column) or nesting
            deeper than ``max_depth`` levels (the JSON path of the first value too deep).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8: byte {e.start} ({raw[e.start:e.start + 1]!r}) "
                        f"cannot be decoded ({e.reason})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                        f"(char {e.pos})") from None
    except RecursionError:
        raise BodyError(f"request body is nested deeper than {max_depth} levels") from None
    path = _too_deep(value, max_depth)
    if path is not None:
        raise BodyError(f"request body is nested deeper than {max_depth} levels at {path[:EXCERPT_CHARS]}")
    return value


# ---------------------------------------------------------------- route class

_endpoint_started: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("flywheel_endpoint_started",
                                                                                    default=None)


def _mark_started(endpoint: Callable) -> Callable:
    """``endpoint`` wrapped so that the request's holder records that validation is over."""
    if getattr(endpoint, "_flywheel_marked", False):
        return endpoint

    if inspect.iscoroutinefunction(endpoint):
        @functools.wraps(endpoint)
        async def wrapper(*args, **kwargs):
            holder = _endpoint_started.get()
            if holder is not None:
                holder[0] = True
            return await endpoint(*args, **kwargs)
    else:
        @functools.wraps(endpoint)
        def wrapper(*args, **kwargs):
            holder = _endpoint_started.get()  # the thread runs in a copy of the request's context
            if holder is not None:
                holder[0] = True
            return endpoint(*args, **kwargs)
    wrapper._flywheel_marked = True  # type: ignore[attr-defined]
    return wrapper


def _is_json(request: Request) -> bool:
    ct = request.headers.get("content-type", "")
    main = ct.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


BAD_BODY = {"description": "The body is not JSON: invalid UTF-8, invalid JSON or nested too deep (the detail "
                           "says what and where)."}
"""OpenAPI response 400 of every route with a JSON body."""


class CheckedRoute(APIRoute):
    """The API route class of the scheduler and the sandbox (``APIRouter(route_class=CheckedRoute)``).

    - A JSON body is read and parsed with :func:`parse_json_body` before FastAPI sees it: invalid UTF-8,
      invalid JSON and nesting deeper than :data:`MAX_BODY_DEPTH` get a 400 saying what and where.
    - Never a 500 on client input: an exception other than an HTTP or validation error raised while the
      request is validated (a validator that fails in an unforeseen way) is logged with its traceback
      and answered 422 naming the body; one raised once the endpoint runs is a server bug and stays a
      500 (logged by the server).
    """

    def __init__(self, path: str, endpoint: Callable, **kwargs: Any) -> None:
        super().__init__(path, _mark_started(endpoint), **kwargs)
        if self.body_field is not None and 400 not in self.responses and "400" not in self.responses:
            self.responses = {**self.responses, 400: BAD_BODY}

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        has_body = bool(self.body_field)

        async def checked(request: Request) -> Response:
            if has_body and _is_json(request):
                raw = await request.body()
                if raw:
                    try:
                        request._json = parse_json_body(raw)  # Starlette's cache: FastAPI reads it
                    except BodyError as e:
                        return _error_response(e.status, e.detail)
            holder = [False]
            token = _endpoint_started.set(holder)
            try:
                return await handler(request)
            except (StarletteHTTPException, RequestValidationError):
                raise
            except Exception as e:
                if holder[0]:
                    raise  # the endpoint's own failure: a server bug, a 500
                log.warning("%s %s: validating the request raised %s", request.method, request.url.path,
                            type(e).__name__, exc_info=True)
                raise RequestValidationError([{
                    "type": "value_error", "loc": ("body",),
                    "msg": f"the request could not be validated: {type(e).__name__}: {e}", "input": None,
                }]) from None
            finally:
                _endpoint_started.reset(token)

        return checked


# ---------------------------------------------------------------- error bodies


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> Any:
    """``value`` for an error body: a string, or a container's JSON, cut to ``limit`` characters (with
    the full length said); small numbers, booleans and None unchanged."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        s = repr(value)
        return value if len(s) <= limit else f"{s[:limit]}… ({len(s)} characters)"
    if not isinstance(value, str):
        try:
            value = json.dumps(jsonable_encoder(value), ensure_ascii=False, default=repr)
        except Exception:  # noqa: BLE001 - an error body must never fail
            value = repr(value)
        if len(value) <= limit:
            return json.loads(value) if value[:1] in "[{" else value
    if len(value) <= limit:
        return value
    return f"{value[:limit]}… ({len(value)} characters)"


def _short_error(er: dict[str, Any]) -> dict[str, Any]:
    out = {k: er[k] for k in ("type", "loc", "msg") if k in er}
    out["loc"] = [x if isinstance(x, int) else excerpt(str(x), 100) for x in er.get("loc", ())]
    out["msg"] = excerpt(str(er.get("msg", "")), MSG_CHARS)
    if "input" in er:
        out["input"] = excerpt(er["input"])
    if er.get("ctx"):
        out["ctx"] = {k: excerpt(v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
                      for k, v in er["ctx"].items()}
    return out


def _error_response(status: int, detail: Any) -> Response:
    return Response(json.dumps({"detail": detail}, ensure_ascii=True), status_code=status,
                    media_type="application/json")


MAX_ERRORS = 20
"""Validation errors listed in one 422 body (the count of the rest is said)."""


def validation_detail(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors of a 422 body: each cut to short excerpts, at most :data:`MAX_ERRORS`."""
    out = [_short_error(er) for er in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        out.append({"type": "too_many_errors", "loc": ["body"], "msg": f"{len(errors) - MAX_ERRORS} more errors"})
    return out


def install_validation_handler(app: FastAPI) -> None:
    """Answer request validation errors with 422 and ASCII-escaped JSON whose echoed input is short.

    FastAPI's own handler echoes the whole offending input (a 64 MB invalid body came back whole) as
    UTF-8, and fails with a 500 when that input holds a lone surrogate (``"\\ud800"`` is valid JSON but
    not UTF-8 text); here each error's ``input`` is cut to :data:`EXCERPT_CHARS` characters and escaped
    JSON carries any string. :class:`BodyError` (raised by a route that parses its own body) is a 400.
    """

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(422, validation_detail(list(exc.errors())))

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, exc: BodyError) -> Response:
        return _error_response(exc.status, exc.detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI's answer, except that a 405's ``Allow`` lists the methods of every route of the path
        (Starlette names only those of the first route that matched it, RFC 9110 §15.5.6 wants all)."""
        if exc.status_code == 405:
            allowed = _allowed_methods(request)
            if allowed:
                exc = StarletteHTTPException(405, exc.detail, headers={**(exc.headers or {}),
                                                                       "Allow": ", ".join(allowed)})
        return await http_exception_handler(request, exc)


def _allowed_methods(request: Request) -> list[str]:
    from starlette.routing import Match

    routes = request.app.router.routes
    return [m for m in ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
            if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]
