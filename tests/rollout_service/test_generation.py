"""The engine gate: one generation at a time across coroutines, busy time measured, and the stats'
utilisation metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollout_service.emit import RolloutStats
from rollout_service.engine import Engine, EngineGate, GenerationRequest, Sample
from shared.schemas import SamplingParams


class _SlowEngine(Engine):
    """Generates after ``delay_s`` seconds and records how many calls ever ran at once."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.running, self.most, self.calls = delay_s, 0, 0, []
        self._count = threading.Lock()

    def generate(self, requests):
        with self._count:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay_s)
            self.calls.append(len(requests))
            return [[Sample([1], [0.0], "stop")] * r.n for r in requests]
        finally:
            with self._count:
                self.running -= 1

    def update_weights(self, update) -> None:
        raise NotImplementedError


def _req(n: int = 1) -> GenerationRequest:
    return GenerationRequest([1, 2], n, SamplingParams(max_new_tokens=1))


async def test_the_gate_serialises_generate_and_measures_busy_time():
    engine, stats = _SlowEngine(0.2), RolloutStats()
    stats.start()
    gate = EngineGate(engine, on_busy=stats.add_busy)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(gate.generate_timed([_req(k)]) for k in (1, 2, 3)))
    wall = time.perf_counter() - t0
    assert engine.most == 1 and engine.calls == [1, 1, 1]
    assert [len(samples[0]) for samples, _ in outs] == [1, 2, 3]
    assert all(s >= 0.2 for _, s in outs)  # each call's own engine seconds, not its wait for the lock
    assert sum(s for _, s in outs) == pytest.approx(gate.busy_s) and 0.6 <= gate.busy_s <= wall
    assert stats.busy_s == gate.busy_s

    # a cancelled caller: the lock is kept until its generation returns, so the next call never overlaps
    first = asyncio.create_task(gate.generate([_req()]))
    await asyncio.sleep(0.05)
    first.cancel()
    await gate.generate([_req()])
    assert engine.most == 1 and len(engine.calls) == 5
    u = stats.utilisation()
    assert set(u) == {"rollout/busy_s", "rollout/wall_s", "rollout/idle_fraction"}
    assert 0 < u["rollout/busy_s"] <= u["rollout/wall_s"] and 0 <= u["rollout/idle_fraction"] <= 1


def test_utilisation_is_absent_before_the_start_and_clipped():
    stats = RolloutStats()
    assert stats.utilisation() == {}
    stats.start()
    stats.add_busy(1e6)  # more than the wall time (cannot happen through one gate): clipped, not negative
    assert stats.utilisation()["rollout/idle_fraction"] == 0.0
    stats.samples = 1
    assert "rollout/idle_fraction" in stats.metrics(0)
