"""The scheduler while its broker is gone: a private Tansu per test, killed with -9 (and, in one test, started
again empty on the same port).

Checked: a commit that would be made while the broker is away gives up at once (the sampler's
:class:`shared.kafka.BrokerWatch` guards it) instead of waiting for a coordinator that is not there, the
consumer loops wait for the broker and start over from the committed offsets, and a reward produced after it
is back completes the group with the one recorded before the outage, and no consumer dropped during it keeps
a connection; stopping the scheduler while the broker is gone returns within a few seconds and logs no error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from scheduler_service.api import create_app
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared import topics
from shared.kafka import ensure_topics
from tests.scheduler_service.test_broker_restart import _config, _kafka, _produce, _requests, _reward, _task, _wait

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]  # kills the broker: the e2e tier

GIVE_UP_S = 5.0
"""Bound from the broker's death to the rewards loop giving up its commit (unguarded, the commit waited until the
broker was back)."""
STOP_S = 6.0
"""Bound on stopping the whole scheduler (sampler, consumers, producer) with the broker gone."""


def _errors(caplog) -> list[str]:
    """Records with a traceback, and the scheduler's (and asyncio's) records at ERROR or above. (aiokafka logs
    each failed connection at ERROR, without a traceback, while the broker is gone: not ours to silence.)"""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.exc_info or r.exc_text or (r.levelno >= logging.ERROR
                                            and r.name.split(".")[0] in ("scheduler_service", "shared", "asyncio"))]


def _connections_to(port: int) -> list[str]:
    """Established TCP connections to ``port`` on this host (``/proc/net/tcp``; only this test talks to its
    private broker), as ``local -> remote`` hex addresses."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [f"{r[1]} -> {r[2]}" for r in rows if int(r[2].split(":")[1], 16) == port and r[3] == "01"]


def _kill_after_the_first_reward(sampler, broker) -> list[float]:
    """Have the broker die (SIGKILL) once the sampler's rewards loop has recorded its first reward in SQLite and
    before it commits the batch's offsets; returns the list that gets the monotonic time of the kill."""
    gone: list[float] = []
    on_reward = sampler.guard.on_reward

    async def then_kill(ev, **kw) -> None:  # called by the rewards loop for each reward counted in SQLite
        await on_reward(ev, **kw)
        if not gone:
            os.kill(broker.pid, signal.SIGKILL)
            broker.process.wait(10)
            gone.append(time.monotonic())
            await asyncio.sleep(1.0)  # every client has seen it by now

    sampler.guard.on_reward = then_kill
    return gone


async def _one_group_out(kafka, state, task, tid: str):
    """Register task ``tid`` and read the request of its group (n = 2)."""
    state.registry.register_tasks([_task(task, tid)])
    (req,) = await _requests(kafka, lambda r: r.task.task_id == tid, 1, 20)
    assert req.n == 2
    return req


async def test_a_commit_while_the_broker_is_gone_gives_up_and_the_loops_resume_after_it(
        make_config, unique, running, task, private_broker, caplog):
    broker, restart = private_broker
    kafka = _kafka(broker)
    await ensure_topics(kafka)
    tid = f"{unique}-t"
    cfg = _config(make_config, kafka, unique, group_deadline_s=600)
    caplog.set_level(logging.INFO)
    async with running(cfg) as (client, state):
        sampler = state.sampler
        req = await _one_group_out(kafka, state, task, tid)
        gone = _kill_after_the_first_reward(sampler, broker)
        await _produce(kafka, (topics.REWARDS, _reward(req, 0), tid))
        assert await _wait(lambda: gone, 30), "the reward was not handled"
        assert state.registry.get_group(req.group_id)["received"] == 1  # acknowledged: in SQLite

        def given_up():
            return [r for r in caplog.records if r.getMessage().startswith("_rewards_loop: broker unreachable")]

        lost = await _wait(given_up, GIVE_UP_S + 5)
        assert lost, "the rewards loop still waits on its commit with the broker gone"
        took = lost[0].created - (time.time() - (time.monotonic() - gone[0]))
        print(f"commit given up {took:.2f} s after the broker died")
        assert took < GIVE_UP_S

        restart()  # empty, same port
        t0 = time.monotonic()
        assert await _wait(lambda: sampler.watch.epoch >= 1, 20), "the watch did not see the broker come back"
        assert await _wait(lambda: sampler.broker_restarts >= 1, 20), "the topics were not re-created"
        await _produce(kafka, (topics.REWARDS, _reward(req, 1), tid))
        assert await _wait(lambda: state.registry.get_group(req.group_id)["state"] == "complete", 40), \
            state.registry.get_group(req.group_id)
        print(f"reward produced after the broker came back counted {time.monotonic() - t0:.1f} s after the restart")
        assert state.registry.get_group(req.group_id)["received"] == 2
    # the consumers dropped during the outage are closed for good: none reconnected to the new broker
    assert await _wait(lambda: not _connections_to(broker.port), 5), _connections_to(broker.port)
    assert not _errors(caplog), _errors(caplog)


async def test_stopping_the_scheduler_while_the_broker_is_gone_is_quick_and_quiet(
        make_config, unique, task, private_broker, caplog):
    """The broker dies while the rewards loop holds an uncommitted batch and a task publish is under way; then
    the app's lifespan ends."""
    broker, _ = private_broker
    kafka = _kafka(broker)
    await ensure_topics(kafka)
    tid = f"{unique}-t"
    cfg = _config(make_config, kafka, unique, group_deadline_s=600)
    caplog.set_level(logging.INFO)
    registry = Registry.from_url(cfg.scheduler.database_url, cfg.run)
    try:
        state = SchedulerState(cfg, registry)
        app = create_app(cfg, state)
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(app.router.lifespan_context(app))
            req = await _one_group_out(kafka, state, task, tid)
            gone = _kill_after_the_first_reward(state.sampler, broker)
            await _produce(kafka, (topics.REWARDS, _reward(req, 0), tid))
            assert await _wait(lambda: gone, 30), "the reward was not handled"
            state.publish_tasks([_task(task, f"{tid}-late")])
            await asyncio.sleep(1.5)
            caplog.clear()
            t0 = time.monotonic()
            await stack.aclose()
            took = time.monotonic() - t0
    finally:
        registry.close()
    print(f"scheduler stopped {took:.2f} s after being asked, the broker gone")
    assert took < STOP_S
    assert not _errors(caplog), _errors(caplog)
