"""Bearer-token authentication for the mutating routes of the scheduler and the sandbox.

One shared secret per system (``auth`` config section, :class:`shared.config.AuthConfig`): the
scheduler and the sandbox require ``Authorization: Bearer <token>`` on every route that changes
state (HTTP 401 otherwise); reads stay open on loopback. Clients (``flywheel`` CLI, the verifier
and the rollout's calls to the sandbox) send it with :func:`auth_headers`.

Where the token comes from, first found wins: ``FLYWHEEL_AUTH__TOKEN``, then the file
``auth.token_file`` (default ``<run dir>/auth_token``). :func:`ensure_token_file` writes a new random
token there with mode 0600 (the embedded launcher does it before any service starts; a server that
finds no token does it too, so a mutating route is never open by accident).

This guards the HTTP APIs only. The embedded broker (Tansu) has no authentication: any local process
that can reach its port can produce records. On a shared host run Apache Kafka with SASL/PLAIN or
mTLS (docs/security.md).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shared.config import AuthConfig, RunConfig

#: Name of the OpenAPI security scheme.
SCHEME_NAME = "bearerAuth"
TOKEN_BYTES = 32


class TokenError(RuntimeError):
    """No token could be read or written (the message names the file)."""


def token_path(auth: AuthConfig, run: RunConfig) -> Path:
    """The token file: ``auth.token_file`` resolved against ``run.dir``."""
    return run.path(auth.token_file)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (created so, never world-readable in between).

    Raises:
        OSError: the directory is not writable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_token_file(path: str | os.PathLike) -> str:
    """Return the token stored in ``path``; create the file with a new random token (mode 0600) if absent.

    Raises:
        TokenError: the file exists but is empty, or cannot be read or written.
    """
    path = Path(path)
    try:
        if not path.exists():
            write_private(path, (secrets.token_urlsafe(TOKEN_BYTES) + "\n").encode())
        token = path.read_text().strip()
    except OSError as e:
        raise TokenError(f"cannot read or write the auth token file {path}: {e}") from e
    if not token:
        raise TokenError(f"the auth token file {path} is empty")
    return token


def read_token(auth: AuthConfig, run: RunConfig) -> str | None:
    """The configured token: ``auth.token``, else the content of the token file; None when neither exists.

    Raises:
        TokenError: the token file exists but cannot be read or is empty.
    """
    if auth.token:
        return auth.token
    path = token_path(auth, run)
    if not path.exists():
        return None
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise TokenError(f"cannot read the auth token file {path}: {e}") from e
    if not token:
        raise TokenError(f"the auth token file {path} is empty")
    return token


def server_token(auth: AuthConfig, run: RunConfig) -> str | None:
    """The token a server checks: the configured one, else a new one written to the token file.
    None when ``auth.required`` is false.

    Raises:
        TokenError: the token file cannot be read or written.
    """
    if not auth.required:
        return None
    return read_token(auth, run) or ensure_token_file(token_path(auth, run))


def auth_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or ``{}`` when ``token`` is None."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def token_from_run_dir(run_dir: str | os.PathLike | None) -> str | None:
    """For clients: ``$FLYWHEEL_AUTH__TOKEN``, else ``$FLYWHEEL_AUTH__TOKEN_FILE``, else ``<run_dir>/auth_token``;
    None when none exists. Never raises for a missing file."""
    env = os.environ.get("FLYWHEEL_AUTH__TOKEN")
    if env:
        return env
    candidates = [os.environ.get("FLYWHEEL_AUTH__TOKEN_FILE")]
    if run_dir is not None:
        candidates.append(str(Path(run_dir) / "auth_token"))
    for c in candidates:
        if c:
            try:
                token = Path(os.path.expanduser(c)).read_text().strip()
            except OSError:
                continue
            if token:
                return token
    return None


_bearer = HTTPBearer(scheme_name=SCHEME_NAME, auto_error=False,
                     description="The system's token: `<run dir>/auth_token` in the embedded mode, "
                                 "`FLYWHEEL_AUTH__TOKEN` in compose.")


def require_token(request: Request,
                  credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """FastAPI dependency: HTTP 401 unless the request carries the app's token.

    The app keeps the expected token in ``app.state.auth_token`` (None = no check); the comparison is
    constant-time (:func:`hmac.compare_digest`).

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer`` when the token is missing or wrong.
    """
    expected = getattr(request.app.state, "auth_token", None)
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not given or not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                            detail="missing or wrong bearer token (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})


#: Put on every mutating route: ``@router.post(..., dependencies=AUTH)``; OpenAPI lists the 401.
AUTH = [Depends(require_token)]
AUTH_RESPONSES = {401: {"description": "Missing or wrong bearer token."}}
