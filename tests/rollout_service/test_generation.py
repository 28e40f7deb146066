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


async def test_the_gate_serialises_generate_serves_waiting_calls_together_and_measures_busy_time():
    engine, stats = _SlowEngine(0.2), RolloutStats()
    stats.start()
    gate = EngineGate(engine, on_busy=stats.add_busy)
    outs = await asyncio.gather(*(gate.generate_timed([_req(k)]) for k in (1, 2, 3)))
    assert engine.most == 1 and engine.calls == [3]  # the three calls of one event-loop turn: one engine call
    assert [len(samples[0]) for samples, _ in outs] == [1, 2, 3]  # each caller gets its own samples back
    assert all(s == outs[0][1] >= 0.2 for _, s in outs) and gate.busy_s == pytest.approx(outs[0][1])

    # calls made while the engine runs wait for it, then go to the engine together
    first = asyncio.create_task(gate.generate([_req()]))
    await asyncio.sleep(0.05)
    later = [asyncio.create_task(gate.generate([_req(2), _req()])) for _ in range(3)]
    got = await asyncio.gather(first, *later)
    assert engine.most == 1 and engine.calls == [3, 1, 6]
    assert [[len(x) for x in g] for g in got] == [[1], [2, 1], [2, 1], [2, 1]]

    # a cancelled caller: its engine call runs to the end, so the next call never overlaps it
    first = asyncio.create_task(gate.generate([_req()]))
    await asyncio.sleep(0.05)
    first.cancel()
    await gate.generate([_req()])
    assert engine.most == 1 and engine.calls == [3, 1, 6, 1, 1] and gate.calls == 5
    assert stats.busy_s == pytest.approx(gate.busy_s) and 1.0 <= gate.busy_s
    u = stats.utilisation()
    assert set(u) == {"rollout/busy_s", "rollout/wall_s", "rollout/idle_fraction"}
    assert 0 < u["rollout/busy_s"] <= u["rollout/wall_s"] and 0 <= u["rollout/idle_fraction"] <= 1


async def test_an_engine_error_reaches_every_call_it_served_and_the_gate_goes_on():
    class Failing(_SlowEngine):
        def generate(self, requests):
            if len(self.calls) == 0:
                self.calls.append(len(requests))
                raise RuntimeError("engine broke")
            return super().generate(requests)

    gate = EngineGate(Failing(0.01))
    got = await asyncio.gather(*(gate.generate([_req()]) for _ in range(2)), return_exceptions=True)
    assert [str(g) for g in got] == ["engine broke", "engine broke"]
    assert len((await gate.generate([_req(3)]))[0]) == 3


def test_utilisation_is_absent_before_the_start_and_clipped():
    stats = RolloutStats()
    assert stats.utilisation() == {}
    stats.start()
    stats.add_busy(1e6)  # more than the wall time (cannot happen through one gate): clipped, not negative
    assert stats.utilisation()["rollout/idle_fraction"] == 0.0
    stats.samples = 1
    assert "rollout/idle_fraction" in stats.metrics(0)
