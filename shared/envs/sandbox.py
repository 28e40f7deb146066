"""A rollout's sandbox: code that an environment's tools and hooks run, in a workspace that lives across turns.

A tool, ``setup``, ``env_response`` or ``cleanup`` that takes a parameter named ``sandbox`` gets this rollout's
:class:`Sandbox` (never from the model: it is left out of the tool's schema). Its executions run in the sandbox
service under the service's isolation (namespaces, seccomp, Landlock, cgroups, a uid of their own), never in the
rollout's process, in one *session*: ``/work`` starts as a copy of the environment's ``workspace`` directory
(or empty) and keeps what a run writes, deletes or renames for the next run of the same rollout, while other
rollouts, even of the same task, each have their own. :meth:`Sandbox.snapshot` names the workspace's state and
:meth:`Sandbox.rollback` returns to it (undo a destructive edit). The session is made at the rollout's first
call, and ends when the rollout ends (after ``cleanup``) or at its deadline, whichever comes first; rewards run
later in the verifier and read what ``cleanup`` (or a tool) put in the rollout's ``state``.

The workspace goes to the sandbox once per service process and content (a tar archive named by its sha256;
``PUT /v1/workspaces/{digest}``), and each session starts from it in constant time (sandbox_service/sessions.py:
overlay layers; docs/sandbox.md). Methods raise :class:`SandboxError` for a failure of the sandbox itself (it
cannot be reached, answers 5xx, reports ``infra_error``, the session is gone): in a tool or hook it makes the
rollout an ``error`` sample, never an observation the model is blamed for. A request the sandbox refuses as given
(an unknown snapshot, too many snapshots, a bad argument such as an unknown language) raises ``ValueError`` with
the sandbox's reason: in a tool, an observation the model reads and can act on. A program that fails
(``runtime_error``, ``timeout``, ...) is not an error: its result says so.
"""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import httpx

from shared.client import SANDBOX_RETRY_S, ApiStatusError, AsyncApiClient, RetryPolicy, Token
from shared.envs.workspace import SandboxError, Workspace, pack_workspace

SESSION_TTL_S = 600.0
"""Default deadline of a rollout's session (seconds from its creation); the sandbox ends it then in any case."""

REFUSED = (400, 409, 413, 422)
"""Statuses that refuse a request as given (the caller's fault, a ``ValueError``), not a failure of the sandbox."""


class Sandbox:
    """One rollout's session in the sandbox service (see the module docstring). The rollout makes one per rollout;
    :meth:`connect` makes one by hand, to try tools and hooks outside a run.

    Args:
        http: the rollout service's client of the sandbox (its URL, bearer token and retry policy).
        workspace: what ``/work`` starts as (``None``: empty).
        ttl_s: the session's deadline, seconds after its creation.
        timeout_s: the default wall-clock limit of one execution (seconds).
    """

    def __init__(self, http: AsyncApiClient, workspace: Workspace | None = None, ttl_s: float = SESSION_TTL_S,
                 timeout_s: float = 10.0) -> None:
        self.http, self.workspace, self.ttl_s, self.timeout_s = http, workspace, ttl_s, timeout_s
        self.session_id: str | None = None
        self._opening = asyncio.Lock()
        self._closed = False
        self._own_client = False

    @classmethod
    def connect(cls, url: str, token: Token = None, workspace: str | os.PathLike | None = None,
                **kwargs: Any) -> "Sandbox":
        """A sandbox of one's own, to try tools and hooks outside a run (``await sb.close()`` when done)::

            sb = Sandbox.connect("http://127.0.0.1:8100", token, workspace="repo")
            print(await sb.run("ls", language="bash"))

        Args:
            url: a running sandbox service (``python -m sandbox_service``; docs/guides/sandbox-environments.md).
            token: its bearer token (``None``: ``$FLYWHEEL_AUTH__TOKEN``, else ``$FLYWHEEL_AUTH__TOKEN_FILE``).
            workspace: a directory the session starts from (``None``: empty).
            kwargs: ``ttl_s``, ``timeout_s`` as the constructor's.

        Raises:
            ValueError: ``workspace`` as :func:`pack_workspace`.
        """
        from shared.auth import token_from_run_dir  # here: it loads FastAPI, which a rollout's sandbox never needs

        http = AsyncApiClient(url, token if token is not None else (lambda: token_from_run_dir(None)), timeout=30.0,
                              retry=RetryPolicy(deadline_s=60.0, retry_for_s=SANDBOX_RETRY_S, max_backoff_s=2.0))
        box = cls(http, None if workspace is None else pack_workspace(os.path.abspath(workspace)), **kwargs)
        box._own_client = True
        return box

    async def run(self, code: str, language: str = "python", *, stdin: str = "", files: dict[str, str] | None = None,
                  tests: list[dict[str, str]] | None = None, entry_point: str | None = None,
                  timeout_s: float | None = None, **limits: Any) -> dict[str, Any]:
        """Run ``code`` with ``/work`` the session's workspace (its working directory); ``files`` are written into
        the workspace first. ``tests`` (``[{name, code}]``, Python only) run against ``code`` as the sandbox's
        test-harness mode. Other keywords are :class:`sandbox_service.schemas.ExecuteRequest`'s limits
        (``memory_mb``, ``max_processes``, ``disk_mb``, ``cpu_time_s``, ``output_limit_bytes``).

        Returns:
            the sandbox's result: ``status`` (``ok``, ``runtime_error``, ``timeout``, ``memory_limit``,
            ``output_limit``, ``killed``), ``exit_code``, ``stdout``, ``stderr``, ``wall_s``, and with tests
            ``tests`` (``[{name, status, message}]``), ``tests_passed``, ``tests_total``.

        Raises:
            SandboxError: the sandbox failed (see the class docstring).
            ValueError: the sandbox refused the request as given (HTTP 422: a bad argument, the field named).
        """
        body: dict[str, Any] = {"code": code, "language": language, "stdin": stdin, "files": files or {},
                                "timeout_s": self.timeout_s if timeout_s is None else timeout_s, **limits}
        if tests is not None:
            body["tests"] = tests
        if entry_point is not None:
            body["entry_point"] = entry_point
        out = await self._call("POST", "/execute", json=body, deadline_s=body["timeout_s"] + 30.0,
                               timeout=httpx.Timeout(body["timeout_s"] + 30.0, connect=5.0))
        if out.get("status") == "infra_error":
            raise SandboxError(f"sandbox: the execution failed on every attempt: {str(out.get('stderr'))[:300]}")
        return out

    async def read_text(self, path: str, max_bytes: int = 1_000_000) -> str | None:
        """The text of a file as a run sees it (relative to ``/work``, the workspace; an absolute path reads the
        sandbox's own read-only view, never the host's), undecodable bytes replaced, or ``None`` when it does not
        exist. At most ``max_bytes`` bytes are read.

        Raises:
            SandboxError: as :meth:`run`.
        """
        code = (f"import base64\ntry:\n    data = open({path!r}, 'rb').read({int(max_bytes)})\n"
                "except (FileNotFoundError, IsADirectoryError, NotADirectoryError):\n    print('-')\n"
                "else:\n    print('+' + base64.b64encode(data).decode())\n")
        out = await self.run(code, output_limit_bytes=min(16 * 2**20, max_bytes * 4 // 3 + 64))
        text = out.get("stdout", "")
        if out.get("status") != "ok" or not text.startswith(("+", "-")):
            raise SandboxError(f"sandbox: reading {path!r} failed ({out.get('status')}: {str(out.get('stderr'))[:200]})")
        return None if text.startswith("-") else base64.b64decode(text[1:].strip()).decode("utf-8", "replace")

    async def snapshot(self) -> int:
        """Name the workspace's state now; :meth:`rollback` returns to it. Snapshot 0 is the starting workspace.

        Raises:
            SandboxError: as :meth:`run`.
            ValueError: the session holds the most snapshots the sandbox allows (``sandbox.max_snapshots``).
        """
        return int((await self._call("POST", "/snapshots"))["snapshot"])

    async def rollback(self, snapshot: int = 0) -> None:
        """Return the workspace to ``snapshot``'s state; snapshots taken after it are dropped.

        Raises:
            SandboxError: as :meth:`run`.
            ValueError: no such snapshot (never taken, or dropped by an earlier rollback).
        """
        await self._call("POST", "/rollback", json={"snapshot": int(snapshot)})

    async def close(self) -> None:
        """End the session (its files are removed); later calls raise :class:`SandboxError`. Never raises."""
        self._closed = True
        sid, self.session_id = self.session_id, None
        try:
            if sid is not None:
                await self.http.request("DELETE", f"/v1/sessions/{sid}", deadline_s=10.0)
        except (httpx.HTTPError, ValueError):
            pass  # the sandbox's reaper ends it at its deadline
        finally:
            if self._own_client:
                await self.http.aclose()

    async def _call(self, method: str, path: str, *, json: Any = None, deadline_s: float = 30.0,
                    timeout: httpx.Timeout | None = None) -> dict[str, Any]:
        sid = await self._session()
        try:
            r = await self.http.request(method, f"/v1/sessions/{sid}{path}", json=json, deadline_s=deadline_s,
                                        timeout=timeout)
            return r.json()
        except ApiStatusError as e:
            if e.status_code in REFUSED or (e.status_code == 404 and "has no snapshot" in e.detail):
                raise ValueError(f"sandbox refused it: {e.detail}") from None
            raise SandboxError(f"sandbox: {e}") from None
        except (httpx.HTTPError, ValueError) as e:
            raise SandboxError(f"sandbox: {type(e).__name__}: {e}") from None

    async def _session(self) -> str:
        """This rollout's session id, made at the first call (the workspace uploaded when the sandbox lacks it)."""
        async with self._opening:
            if self._closed:
                raise SandboxError("sandbox: the rollout's session has ended")
            if self.session_id is None:
                self.session_id = await self._open()
            return self.session_id

    async def _open(self) -> str:
        ws = self.workspace
        body = {"workspace": ws.digest if ws else None, "ttl_s": self.ttl_s}
        try:
            for attempt in range(2):
                try:
                    r = await self.http.request("POST", "/v1/sessions", json=body, deadline_s=30.0)
                    return str(r.json()["session_id"])
                except ApiStatusError as e:
                    if e.status_code != 404 or ws is None or attempt:
                        raise
                await self.http.request("PUT", f"/v1/workspaces/{ws.digest}", content=ws.archive,
                                        headers={"content-type": "application/x-tar"}, deadline_s=60.0)
        except ApiStatusError as e:
            raise SandboxError(f"sandbox: cannot start the rollout's session: {e}") from None
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise SandboxError(f"sandbox: cannot start the rollout's session: {type(e).__name__}: {e}") from None
        raise SandboxError("sandbox: cannot start the rollout's session")  # not reached

