"""HTTP routes of workspaces and sessions (:mod:`sandbox_service.sessions`); every one needs the bearer token.

- ``PUT /v1/workspaces/{digest}``: body a tar archive (gzip optional, detected by its magic bytes); ``digest``
  the sha256 hex of the body as sent (else 422). 200 ``{"digest", "files", "bytes"}``, also when it was put
  before (not unpacked again). 422 names a member that is not a regular file or directory, an absolute path,
  ``..``, or an archive past ``sandbox.max_workspace_mb``.
- ``GET /v1/workspaces/{digest}``: 200 the same, or 404.
- ``POST /v1/sessions``: 201 ``{"session_id", "workspace", "expires_at"}``; 404 unknown workspace; 503 at
  ``sandbox.max_sessions``.
- ``POST /v1/sessions/{id}/execute``: like ``POST /v1/execute`` with /work the session's workspace; one
  execution of a session at a time (later ones wait).
- ``POST /v1/sessions/{id}/snapshots``: 201 ``{"snapshot": k}``; 409 at ``sandbox.max_snapshots``.
- ``POST /v1/sessions/{id}/rollback``: body ``{"snapshot": k}``; 200 ``{"snapshot": k}``; 404 unknown snapshot.
- ``DELETE /v1/sessions/{id}``: 204.

404 for a session that never existed, expired, was deleted or outgrew its disk limit (the detail says which);
501 when the service runs without the ``namespaces`` layer (no overlay mounts).
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import Response

from sandbox_service.pool import Overloaded, Pool
from sandbox_service.schemas import (DIGEST_PATTERN, ExecuteRequest, ExecuteResult, RollbackRequest, SessionAnswer,
                                     SessionRequest, SnapshotAnswer, WorkspaceAnswer)
from sandbox_service.sessions import Full, Session, SessionGone, SessionStore, SessionsUnavailable
from sandbox_service.workspaces import BadWorkspace, WorkspaceInfo, sha256_hex, unpack
from shared.auth import AUTH, AUTH_RESPONSES

Run = Callable[[ExecuteRequest, Request, dict | None], Awaitable[Response]]
"""The API's logged execution (``POST /v1/execute``'s body), here given a session's workspace."""

UNAVAILABLE = {501: {"description": "The service runs without the 'namespaces' layer: no sessions."}}
GONE = {404: {"description": "Unknown session: never opened, expired, deleted or over its disk limit "
                             "(the detail says which)."}}
TAR_BODY = {"requestBody": {"required": True, "description": "A tar archive (optionally gzip-compressed), any "
                            "content type (application/x-tar, application/gzip, application/octet-stream).",
                            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def _field_error(loc: list, msg: str) -> HTTPException:
    """A 422 in the shape of a validation error, naming the field ``loc``."""
    return HTTPException(422, [{"loc": loc, "msg": msg, "type": "value_error"}])


class _Lookup:
    """The lifespan's store and pool, and the 501/404 answers every route shares."""

    def __init__(self, store: Callable[[], SessionStore], pool: Callable[[], Pool]) -> None:
        self.store, self.pool = store, pool

    def available(self) -> SessionStore:
        s = self.store()
        try:
            s.check_available()
        except SessionsUnavailable as e:
            raise HTTPException(501, str(e)) from None
        return s

    def session(self, sid: str) -> tuple[SessionStore, Session]:
        st = self.available()
        try:
            return st, st.get(sid)
        except SessionGone as e:
            raise HTTPException(404, str(e)) from None


def add_session_routes(app: FastAPI, store: Callable[[], SessionStore], pool: Callable[[], Pool], run: Run) -> None:
    """The workspace and session routes on ``app`` (``store`` and ``pool`` read the lifespan's objects)."""
    look = _Lookup(store, pool)
    _workspace_routes(app, look)
    _session_routes(app, look, run)


def _workspace_routes(app: FastAPI, look: _Lookup) -> None:
    digest_path = Path(pattern=DIGEST_PATTERN, description="sha256 hex of the archive's bytes")
    put_locks: dict[str, asyncio.Lock] = {}
    available = look.available

    @app.put("/v1/workspaces/{digest}", response_model=WorkspaceAnswer, dependencies=AUTH, openapi_extra=TAR_BODY,
             responses={**AUTH_RESPONSES, **UNAVAILABLE,
                        413: {"description": "The body is larger than sandbox.max_request_bytes."},
                        422: {"description": "Digest mismatch, not a tar archive, a member that may not be in a "
                                             "workspace, or larger than sandbox.max_workspace_mb."},
                        503: {"description": "The sessions' disk is full."}})
    async def put_workspace(request: Request, digest: str = digest_path) -> dict:
        st = available()
        lock = put_locks.setdefault(digest, asyncio.Lock())
        async with lock:
            if digest in st.templates:
                return st.templates[digest].as_json()
            body = await request.body()
            actual = await asyncio.to_thread(sha256_hex, body)
            if actual != digest:
                raise _field_error(["path", "digest"], f"digest is not the sha256 of the body ({actual})")
            try:
                info = await asyncio.to_thread(unpack, body, st.template_dir(digest), st.cfg.max_workspace_mb * 2**20)
            except BadWorkspace as e:
                raise _field_error(["body"], str(e)) from None
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise HTTPException(503, "sandbox: the sessions' disk (sandbox.sessions_disk_mb) is full") from None
                raise
            finally:
                put_locks.pop(digest, None)
            st.templates[digest] = WorkspaceInfo(digest, info.files, info.bytes)
            return st.templates[digest].as_json()

    @app.get("/v1/workspaces/{digest}", response_model=WorkspaceAnswer, dependencies=AUTH,
             responses={**AUTH_RESPONSES, **UNAVAILABLE, 404: {"description": "Unknown workspace."}})
    async def get_workspace(digest: str = digest_path) -> dict:
        st = available()
        if digest not in st.templates:
            raise HTTPException(404, f"unknown workspace {digest}")
        return st.templates[digest].as_json()


def _session_routes(app: FastAPI, look: _Lookup, run: Run) -> None:
    available, session, pool = look.available, look.session, look.pool

    @app.post("/v1/sessions", status_code=201, response_model=SessionAnswer, dependencies=AUTH,
              responses={**AUTH_RESPONSES, **UNAVAILABLE,
                         404: {"description": "Unknown workspace: PUT /v1/workspaces/{digest}, then retry."},
                         503: {"description": "sandbox.max_sessions sessions are open, or the sessions' disk is full."}})
    async def open_session(body: SessionRequest) -> dict:
        st = available()
        try:
            s = st.open(body.workspace, body.ttl_s, body.disk_mb)
        except KeyError:
            raise HTTPException(404, f"unknown workspace {body.workspace}: PUT /v1/workspaces/{body.workspace} "
                                "first") from None
        except Full as e:
            raise HTTPException(503, str(e)) from None
        except OSError as e:
            raise HTTPException(503, f"sandbox: cannot make the session's directories: {e}") from None
        return {"session_id": s.id, "workspace": s.workspace, "expires_at": s.expires_at}

    @app.post("/v1/sessions/{session_id}/execute", response_model=ExecuteResult, dependencies=AUTH,
              responses={**AUTH_RESPONSES, **UNAVAILABLE, **GONE,
                         413: {"description": "The body is larger than sandbox.max_request_bytes."},
                         503: {"description": "Queue full, circuit breaker open or shutting down: retry later."}})
    async def session_execute(session_id: str, req: ExecuteRequest, request: Request) -> Response:
        st, s = session(session_id)
        try:
            pool().admit()
        except Overloaded as e:
            raise HTTPException(503, str(e)) from None
        async with s.lock:
            st, s = session(session_id)  # it may have ended while this waited
            res = await run(req, request, s.wire())
            await st.after_run(s)
        return res

    @app.post("/v1/sessions/{session_id}/snapshots", status_code=201, response_model=SnapshotAnswer,
              dependencies=AUTH, responses={**AUTH_RESPONSES, **UNAVAILABLE, **GONE,
                                            409: {"description": "The session holds sandbox.max_snapshots."}})
    async def snapshot(session_id: str) -> dict:
        st, s = session(session_id)
        async with s.lock:
            st, s = session(session_id)
            try:
                return {"snapshot": await st.snapshot(s)}
            except Full as e:
                raise HTTPException(409, str(e)) from None
            except SessionGone as e:
                raise HTTPException(404, str(e)) from None

    @app.post("/v1/sessions/{session_id}/rollback", response_model=SnapshotAnswer, dependencies=AUTH,
              responses={**AUTH_RESPONSES, **UNAVAILABLE, 404: {"description": "Unknown session or snapshot."}})
    async def rollback(session_id: str, body: RollbackRequest) -> dict:
        st, s = session(session_id)
        async with s.lock:
            st, s = session(session_id)
            try:
                st.rollback(s, body.snapshot)
            except KeyError:
                raise HTTPException(404, f"session {session_id!r} has no snapshot {body.snapshot} "
                                    f"(it holds 0..{len(s.layers)})") from None
        return {"snapshot": body.snapshot}

    @app.delete("/v1/sessions/{session_id}", status_code=204, response_class=Response, dependencies=AUTH,
                responses={**AUTH_RESPONSES, **UNAVAILABLE, **GONE})
    async def delete_session(session_id: str) -> Response:
        st, _ = session(session_id)
        st.delete(session_id)
        return Response(status_code=204)
