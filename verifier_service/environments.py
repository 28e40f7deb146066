"""Users' reward functions (the ``environment`` verifier kind), run in worker processes, one pool per environment.

Each environment reference gets ``verifier.reward_workers`` spawned processes (:class:`RewardPool`): each imports
the user's code once and scores the calls it is sent, many per message (see :mod:`verifier_service.reward_batch`
for the batching). A call past ``verifier.reward_timeout_s`` kills the worker scoring it (a function that never
returns cannot be interrupted any other way) and is an infrastructure error, like a function that raises or
returns a non-number: the verifier retries it and the domain's ``infra_error_rate`` counts it, never a 0 reward.
The other calls, other environments' pools and the built-in kinds are not touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import orjson

from shared.envs import EnvironmentLoadError
from shared.verifier_specs import EnvironmentSpec
from verifier_service.config import VerifierConfig
from verifier_service.deterministic import CheckResult, infra
from verifier_service.reward_batch import RewardPool

log = logging.getLogger(__name__)

WARM_TIMEOUT_S = 120.0
"""Bound on starting a pool: spawning its processes and importing the environment there (seconds)."""
LOAD_RETRY_S = 30.0
"""An environment that failed to load is not tried again for this long (seconds): its calls fail at once."""


def kill_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop ``pool`` now: kill its workers (one may be stuck in user or library code that never returns) and shut
    it down without waiting; its pending futures are cancelled."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    pool.shutdown(wait=False, cancel_futures=True)


class EnvironmentScorer:
    """Scores ``environment`` specs; owns one :class:`RewardPool` per environment reference. Use from one event
    loop; call :meth:`close` when done."""

    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self._pools: dict[str, RewardPool] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, tuple[float, str]] = {}

    async def score(self, spec: EnvironmentSpec, completion: str, prompt: list[dict[str, str]] | None,
                    rollout: dict[str, Any] | None = None) -> CheckResult:
        """The ``correctness`` layer of one completion: the rubric's weighted mean, its per-function rewards and
        metrics in the details. ``rollout`` (a multi-turn rollout's ``state``, ``tool_calls``, ``turns`` and last
        assistant turn as ``completion``) overrides the single-turn defaults. Never raises for the user's code or
        the pool (both give ``infra_error``)."""
        key = spec.environment.key()
        rollout = {k: v for k, v in (rollout or {}).items() if v is not None}
        context = orjson.dumps({"prompt": prompt or spec.row.get("prompt", []), "completion": completion,
                                "answer": spec.answer, "info": spec.info, "state": {}, "tool_calls": [],
                                "turns": [], "task": spec.task,
                                **rollout})
        pool = self._pools.get(key)
        if pool is None or pool.dead:
            try:
                pool = await self._pool(key, spec.environment.label())
            except EnvironmentLoadError as e:
                return infra(str(e), misconfigured=True)
            except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError) as e:
                return infra(f"reward pool of {spec.environment.label()} did not start: {e!r}")
        return await pool.score(context)

    async def _pool(self, key: str, label: str) -> RewardPool:
        """The started pool of ``key``; a new one imports the environment in every process first.

        Raises:
            EnvironmentLoadError: the environment cannot be loaded (the pool is not kept).
            asyncio.TimeoutError: the processes did not start within :data:`WARM_TIMEOUT_S`.
        """
        async with self._locks.setdefault(key, asyncio.Lock()):  # one environment's start waits for no other
            pool = self._pools.get(key)
            if pool is not None and not pool.dead:
                return pool
            if pool is not None:  # every worker was lost and none could be restarted
                del self._pools[key]
                await pool.close()
            failed_at, reason = self._failed.get(key, (0.0, ""))
            if time.monotonic() - failed_at < LOAD_RETRY_S:
                raise EnvironmentLoadError(reason)
            pool = RewardPool(key, label, self.cfg)
            t0 = time.perf_counter()
            try:
                await pool.start(WARM_TIMEOUT_S)
            except EnvironmentLoadError as e:
                self._failed[key] = (time.monotonic(), str(e))
                raise
            log.info("reward pool of %d for %s started in %.2f s", self.cfg.reward_workers, key[:200],
                     time.perf_counter() - t0)
            self._pools[key] = pool
            return pool

    async def close(self) -> None:
        """Stop every pool: kill the workers; calls not yet answered get ``infra_error``."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()
