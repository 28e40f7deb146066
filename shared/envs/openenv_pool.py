"""What both transports of an OpenEnv environment share (:mod:`shared.envs.http_env`, :mod:`shared.envs.openenv_ws`):
the servers a process leases to rollouts, the error of a transport, and the reading of a step's answer."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from typing import Any, Sequence

POLL_S = 0.02
"""How often a rollout waiting for a server with room looks again (seconds)."""


class OpenEnvError(RuntimeError):
    """An OpenEnv server could not be used: it did not answer (connection refused, a timeout), answered with a
    status other than 2xx or an ``error`` message, closed the session, or answered something that is not the
    protocol's JSON; or no server of the pool had room in time. Raised in a hook, it makes the rollout an error
    sample (an infrastructure failure, never a 0 reward); the message names the server and the request."""


class ServerPool:
    """Server URLs, each leased to at most ``capacity`` rollouts at a time (``None``: no limit), the least
    leased first. Thread-safe and free of event-loop state, so one pool serves every loop and thread of its
    process.

    Raises:
        ValueError: no URL, a URL without one of ``schemes``, the same URL twice, or a capacity below 1.
    """

    def __init__(self, urls: str | Sequence[str], capacity: int | None = 1,
                 schemes: tuple[str, ...] = ("http://", "https://")) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [str(u).rstrip("/") for u in urls]
        bad = [u for u in self.urls if not u.startswith(schemes)]
        if not self.urls or bad or len(set(self.urls)) != len(self.urls):
            kinds = "/".join(s.removesuffix("://") for s in schemes)
            raise ValueError(f"openenv url: one or more distinct {kinds} URLs, got {urls!r}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, not {capacity!r}")
        self.capacity = capacity
        self._leases: dict[str, set[int]] = {u: set() for u in self.urls}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)

    def try_acquire(self) -> tuple[str, int] | None:
        """The least leased server's URL and the lease's token, or None when every server is at capacity."""
        with self._lock:
            url = min(self.urls, key=lambda u: len(self._leases[u]))
            if self.capacity is not None and len(self._leases[url]) >= self.capacity:
                return None
            token = next(self._tokens)
            self._leases[url].add(token)
            return url, token

    async def acquire(self, wait_s: float) -> tuple[str, int]:
        """A server with room, waiting up to ``wait_s`` seconds for one.

        Raises:
            OpenEnvError: every server stayed at capacity for ``wait_s``.
        """
        deadline = time.monotonic() + wait_s
        while (lease := self.try_acquire()) is None:
            if time.monotonic() >= deadline:
                if self.capacity == 1:
                    raise OpenEnvError(f"all {len(self.urls)} OpenEnv servers are in use (waited {wait_s:g} s): one "
                                       "server plays one rollout at a time; run as many as rollouts play at once")
                raise OpenEnvError(f"all {len(self.urls)} OpenEnv servers have their {self.capacity} sessions in use "
                                   f"(waited {wait_s:g} s): raise sessions_per_server (and the servers' "
                                   "max_concurrent_envs) or run more servers")
            await asyncio.sleep(POLL_S)
        return lease

    def release(self, url: str, token: int) -> bool:
        """End the lease ``token`` of ``url``; whether it held one."""
        with self._lock:
            held = self._leases.get(url)
            if held is None or token not in held:
                return False
            held.discard(token)
            return True

    @property
    def in_use(self) -> int:
        """How many leases are held now."""
        with self._lock:
            return sum(len(held) for held in self._leases.values())


def parse_result(data: dict[str, Any], where: str) -> tuple[dict[str, Any], float | None, bool]:
    """``(observation, reward, done)`` of a reset or step answer.

    Raises:
        OpenEnvError: ``observation`` is not an object, ``reward`` not a finite number or null, ``done`` not a
            boolean.
    """
    observation, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
    if not isinstance(observation, dict):
        raise OpenEnvError(f"{where}: 'observation' is {type(observation).__name__}, not an object "
                           f"(keys of the answer: {sorted(data)[:20]})")
    if reward is not None and (not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        raise OpenEnvError(f"{where}: 'reward' is {str(reward)[:50]!r}, not a finite number or null")
    if not isinstance(done, bool):
        raise OpenEnvError(f"{where}: 'done' is {str(done)[:50]!r}, not a boolean")
    return observation, None if reward is None else float(reward), done
