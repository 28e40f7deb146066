"""Shutdown order of the scheduler state, with fakes that record events."""

from __future__ import annotations

from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState


class _Fake:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    async def stop(self, *_: object) -> None:
        self.events.append(f"{self.name}.stop")


async def test_stop_stops_the_sampler_before_closing_the_producer(make_config, tmp_path):
    events: list[str] = []
    reg = Registry(tmp_path / "r.db")
    try:
        state = SchedulerState(make_config(), reg)
        state.sampler, state.producer = _Fake("sampler", events), _Fake("producer", events)
        await state.stop()
        assert events == ["sampler.stop", "producer.stop"] and state.producer is None
    finally:
        reg.close()


async def test_stop_closes_the_producer_even_when_the_sampler_fails(make_config, tmp_path):
    events: list[str] = []

    class Boom(_Fake):
        async def stop(self, *_: object) -> None:
            events.append("sampler.stop")
            raise RuntimeError("boom")

    reg = Registry(tmp_path / "r.db")
    try:
        state = SchedulerState(make_config(), reg)
        state.sampler, state.producer = Boom("sampler", events), _Fake("producer", events)
        try:
            await state.stop()
        except RuntimeError:
            pass
        assert events == ["sampler.stop", "producer.stop"]
    finally:
        reg.close()
