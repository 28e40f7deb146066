"""Users' reward functions (the ``environment`` verifier kind), run in worker processes, one pool per environment.

A pool of ``verifier.reward_workers`` spawned processes per environment reference: each process imports the
user's code once (:func:`shared.envs.cached_environment`) and runs the rubric for one completion per call. A
call past ``verifier.reward_timeout_s`` kills that environment's pool (a function that never returns cannot be
interrupted any other way) and is an infrastructure error, like a function that raises or returns a
non-number: the verifier retries it and the domain's ``infra_error_rate`` counts it, never a 0 reward.
Other environments' pools, and the built-in kinds, are not touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import time
from typing import Any

import orjson

from shared.envs import EnvironmentLoadError, EnvironmentRef, RewardError, cached_environment
from shared.verifier_specs import EnvironmentSpec
from verifier_service.config import VerifierConfig
from verifier_service.deterministic import CheckResult, infra

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


def _worker_load(key: str) -> dict[str, Any]:
    """In a pool process: import the environment (once per process); the error when it cannot be loaded."""
    try:
        cached_environment(EnvironmentRef.model_validate_json(key))
        return {}
    except EnvironmentLoadError as e:
        return {"reason": str(e), "misconfigured": True}


def _worker_score(key: str, context: bytes) -> tuple[float, dict[str, Any], bool]:
    """In a pool process: the rubric's score of one completion, as ``(score, details, infra_error)``."""
    error = _worker_load(key)
    if error:
        return 0.0, error, True
    env = cached_environment(EnvironmentRef.model_validate_json(key))
    try:
        result = env.rubric.score(**orjson.loads(context))
    except RewardError as e:
        return 0.0, {"reason": str(e)}, True
    return result.score, {"rewards": result.rewards, "metrics": result.metrics}, False


class EnvironmentScorer:
    """Scores ``environment`` specs; owns one process pool per environment reference. Use from one event loop;
    call :meth:`close` when done."""

    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self._pools: dict[str, concurrent.futures.ProcessPoolExecutor] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
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
        try:
            pool = await self._pool(key)
        except EnvironmentLoadError as e:
            return infra(str(e), misconfigured=True)
        except (asyncio.TimeoutError, concurrent.futures.process.BrokenProcessPool, OSError) as e:
            return infra(f"reward pool of {spec.environment.label()} did not start: {e!r}")
        async with self._slots[key]:
            fut = pool.submit(_worker_score, key, context)
            try:
                score, details, infra_error = await asyncio.wait_for(asyncio.wrap_future(fut),
                                                                      timeout=self.cfg.reward_timeout_s)
            except asyncio.TimeoutError:
                self._kill(key, pool)
                return infra(f"reward of {spec.environment.label()} exceeded {self.cfg.reward_timeout_s} s")
            except concurrent.futures.process.BrokenProcessPool as e:
                self._kill(key, pool)
                return infra(f"reward worker of {spec.environment.label()} died: {e!r}")
        return CheckResult(score, details, infra_error)

    async def _pool(self, key: str) -> concurrent.futures.ProcessPoolExecutor:
        """The started pool of ``key``; a new one imports the environment in every process first.

        Raises:
            EnvironmentLoadError: the environment cannot be loaded (the pool is not kept).
            asyncio.TimeoutError: the processes did not start within :data:`WARM_TIMEOUT_S`.
        """
        async with self._locks.setdefault(key, asyncio.Lock()):  # one environment's start waits for no other
            if key in self._pools:
                return self._pools[key]
            failed_at, reason = self._failed.get(key, (0.0, ""))
            if time.monotonic() - failed_at < LOAD_RETRY_S:
                raise EnvironmentLoadError(reason)
            # spawn, not fork: the service process has threads (aiokafka, httpx, to_thread).
            pool = concurrent.futures.ProcessPoolExecutor(max_workers=self.cfg.reward_workers,
                                                          mp_context=multiprocessing.get_context("spawn"))
            t0 = time.perf_counter()
            try:
                warm = [asyncio.wrap_future(pool.submit(_worker_load, key)) for _ in range(self.cfg.reward_workers)]
                errors = [e for e in await asyncio.wait_for(asyncio.gather(*warm), timeout=WARM_TIMEOUT_S) if e]
            except BaseException:
                self._kill(key, pool)
                raise
            if errors:
                self._kill(key, pool)
                self._failed[key] = (time.monotonic(), errors[0]["reason"])
                raise EnvironmentLoadError(errors[0]["reason"])
            log.info("reward pool of %d for %s started in %.2f s", self.cfg.reward_workers, key[:200],
                     time.perf_counter() - t0)
            self._pools[key] = pool
            self._slots.setdefault(key, asyncio.Semaphore(self.cfg.reward_workers))
            return pool

    def _kill(self, key: str, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._pools.get(key) is pool:
            del self._pools[key]
        kill_pool(pool)

    async def close(self) -> None:
        for key, pool in list(self._pools.items()):
            self._kill(key, pool)
