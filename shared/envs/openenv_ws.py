"""OpenEnv's WebSocket transport for :func:`shared.envs.http_env.openenv_environment` (``transport="ws"``).

Current OpenEnv servers (openenv-core 0.2.0 and later, ``HTTPEnvServer`` in ``openenv/core/env_server/
http_server.py``) answer every HTTP ``/reset`` and ``/step`` with a fresh environment: an episode lives only in a
WebSocket session on ``/ws``, one environment per connection, created when the server accepts it and closed when it
ends. The protocol, as the server and its client (``openenv/core/env_client.py``) speak it, JSON text messages:

- the client sends ``{"type": "reset", "data": {...}}`` (the reset's keyword arguments: ``seed``,
  ``episode_id``, the environment's own; the server drops those its ``reset`` does not take),
  ``{"type": "step", "data": {...}}`` (the action itself, validated against the environment's action model),
  ``{"type": "state"}``, or ``{"type": "close"}`` (no answer: the server ends the session and closes);
- the server answers ``{"type": "observation", "data": {"observation": {...}, "reward": float | null,
  "done": bool}}`` to a reset or a step, ``{"type": "state", "data": {...}}`` to a state, and
  ``{"type": "error", "data": {"message": str, "code": str, ...}}`` to what fails, keeping the session open;
  the codes are ``INVALID_JSON``, ``UNKNOWN_TYPE``, ``VALIDATION_ERROR``, ``EXECUTION_ERROR``, and, sent once
  before the server closes the connection, ``CAPACITY_REACHED`` (with ``active_sessions`` and ``max_sessions``:
  the server already holds ``max_concurrent_envs`` sessions, 1 unless its app says more), ``FACTORY_ERROR`` and
  ``SESSION_ERROR``.

Per rollout, :class:`WebSocketTransport` leases a place on a server of the pool (``sessions_per_server`` places
each, no limit by default), opens its own connection to ``<url>/ws`` (``http`` becomes ``ws``, ``https`` ``wss``),
sends the reset in ``setup`` and a step per turn, and in ``cleanup`` sends ``close``, waits for the server to close
(the session is gone on the server then), and gives the place back. The connection object stays in this process
(keyed by the lease, ``state["openenv"]["lease"]``); the state keeps only JSON.

Anything but an observation is an :class:`~shared.envs.http_env.OpenEnvError` in the hook, so an error sample,
never a 0 reward: a connection refused or a handshake the server rejects (an HTTP status: a server without ``/ws``),
no answer within ``timeout_s``, the connection closed mid-episode, a message that is not JSON or not the protocol's,
and every ``error`` message, named with its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.envs.openenv_pool import OpenEnvError, ServerPool, parse_result

log = logging.getLogger(__name__)

WS_SCHEMES = ("http://", "https://", "ws://", "wss://")
"""The URLs the WebSocket transport takes: a server's base URL, as for HTTP, or already ``ws(s)://``."""

MAX_MESSAGE_BYTES = 100 * 1024 * 1024
"""Largest message received (bytes): as OpenEnv's client, room for screenshots and pages in an observation."""


def ws_url(url: str) -> str:
    """The session endpoint of a server's base URL: ``http://h:p`` -> ``ws://h:p/ws``, ``https`` -> ``wss``."""
    url = url.rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(plain):
            url = secure + url[len(plain):]
    return url + "/ws"


def _closed(e: BaseException) -> str:
    """How a connection closed, from websockets' ``ConnectionClosed``: the close code and reason, if any."""
    frame = getattr(e, "rcvd", None) or getattr(e, "sent", None)
    if frame is None:
        return "no close frame"
    return f"code {frame.code}" + (f", {frame.reason[:200]!r}" if frame.reason else "")


def parse_message(raw: str | bytes, where: str) -> tuple[dict[str, Any], float | None, bool]:
    """``(observation, reward, done)`` of a server's answer to a reset or a step.

    Raises:
        OpenEnvError: not JSON, not an object, an ``error`` message (its message and code), a type other than
            ``observation``, or data outside the protocol (see :func:`~shared.envs.http_env.parse_result`).
    """
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise OpenEnvError(f"{where} answered something that is not JSON: {str(raw)[:200]!r}") from e
    if not isinstance(message, dict):
        raise OpenEnvError(f"{where} answered {type(message).__name__}, not a JSON object")
    kind, data = message.get("type"), message.get("data")
    if kind == "error":
        data = data if isinstance(data, dict) else {}
        code = data.get("code", "UNKNOWN")
        text = f"{where}: the server answered an error: {str(data.get('message', ''))[:300]} (code {code})"
        if code == "CAPACITY_REACHED":
            text += ("; the server holds its max_concurrent_envs sessions: raise it, or set sessions_per_server "
                     "to it (rollouts then wait for room)")
        raise OpenEnvError(text)
    if kind != "observation":
        raise OpenEnvError(f"{where} answered a message of type {str(kind)[:50]!r}, not 'observation'")
    if not isinstance(data, dict):
        raise OpenEnvError(f"{where}: the observation message's 'data' is {type(data).__name__}, not an object")
    return parse_result(data, where)


@dataclass(eq=False)
class WebSocketTransport:
    """OpenEnv's ``/ws``, one connection (session) per rollout; the pool counts each server's sessions. The
    connections are this process's, each used by the event loop of its rollout."""

    pool: ServerPool
    timeout_s: float
    acquire_timeout_s: float
    headers: dict[str, str] | None
    name = "ws"
    _connections: dict[int, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def open_sessions(self) -> int:
        """How many connections this transport holds open now."""
        with self._lock:
            return len(self._connections)

    async def begin(self) -> dict[str, Any]:
        """Lease a place on a server and open the rollout's connection: the episode's ``url`` and ``lease``.

        Raises:
            OpenEnvError: no server with room in time, or the connection failed (refused, rejected, late).
        """
        url, token = await self.pool.acquire(self.acquire_timeout_s)
        try:
            connection = await self._connect(ws_url(url))
        except BaseException:
            self.pool.release(url, token)
            raise
        with self._lock:
            self._connections[token] = connection
        return {"url": url, "lease": token}

    async def _connect(self, where: str) -> Any:
        from websockets.asyncio.client import connect  # here: importing shared.envs stays cheap
        from websockets.exceptions import InvalidStatus, WebSocketException

        try:
            return await connect(where, additional_headers=self.headers, open_timeout=self.timeout_s,
                                 close_timeout=self.timeout_s, max_size=MAX_MESSAGE_BYTES, compression=None)
        except InvalidStatus as e:
            status = e.response.status_code
            hint = " (a server without /ws: OpenEnv 0.1.x plays over transport 'http')" if status in (
                403, 404) else ""
            raise OpenEnvError(f"WS {where} refused the connection: HTTP {status}{hint}") from e
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise OpenEnvError(f"WS {where} did not open within {self.timeout_s:g} s") from e
        except (OSError, WebSocketException) as e:
            raise OpenEnvError(f"WS {where} failed to connect: {type(e).__name__}: {str(e)[:300]}") from e

    async def reset(self, episode: dict, body: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        return await self._request(episode, {"type": "reset", "data": body}, "reset")

    async def step(self, episode: dict, action: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        return await self._request(episode, {"type": "step", "data": action}, "step")

    async def _request(self, episode: dict, message: dict[str, Any],
                       what: str) -> tuple[dict[str, Any], float | None, bool]:
        """Send ``message`` on the rollout's connection; the observation it answers, within ``timeout_s``.

        Raises:
            OpenEnvError: no open connection for the episode, no answer in time, the connection closed, or an
                answer other than an observation.
        """
        from websockets.exceptions import ConnectionClosed, WebSocketException

        where = f"WS {ws_url(episode['url'])} {what}"
        with self._lock:
            connection = self._connections.get(episode.get("lease"))  # type: ignore[arg-type]
        if connection is None:
            raise OpenEnvError(f"{where}: this rollout has no open session (its setup did not open one, or its "
                               "cleanup closed it)")
        try:
            async with asyncio.timeout(self.timeout_s):
                with contextlib.suppress(ConnectionClosed):  # the server's last word may be waiting: read it
                    await connection.send(orjson.dumps(message).decode())
                raw = await connection.recv()
        except TimeoutError as e:
            raise OpenEnvError(f"{where} got no answer within {self.timeout_s:g} s") from e
        except ConnectionClosed as e:
            raise OpenEnvError(f"{where}: the server closed the connection ({_closed(e)})") from e
        except (OSError, WebSocketException) as e:
            raise OpenEnvError(f"{where} failed: {type(e).__name__}: {str(e)[:300]}") from e
        return parse_message(raw, where)

    async def end(self, episode: dict) -> None:
        """Close the rollout's session (the ``close`` message, then the server's closing, within ``timeout_s``)
        and give its place back; nothing when it holds none. Never raises: a failure here is only logged."""
        token = episode.pop("lease", None)
        if token is None:
            return
        with self._lock:
            connection = self._connections.pop(token, None)
        try:
            if connection is not None:
                await self._goodbye(connection, ws_url(episode["url"]))
        finally:
            self.pool.release(episode["url"], token)

    async def _goodbye(self, connection: Any, where: str) -> None:
        from websockets.exceptions import ConnectionClosed, WebSocketException

        try:
            async with asyncio.timeout(self.timeout_s):
                with contextlib.suppress(ConnectionClosed):
                    await connection.send('{"type":"close"}')
                await connection.wait_closed()  # the server ends the session, then closes
        except (TimeoutError, OSError, WebSocketException) as e:
            log.warning("OpenEnv session at %s did not close cleanly (%s): dropping the connection", where,
                        type(e).__name__)
            connection.transport.abort()
