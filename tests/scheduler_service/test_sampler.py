"""The sampler against the real embedded broker: flow control, rewards, DLQ, evals, deadlines.

Topics are shared by the whole test session, so ids are unique per test and every read is
filtered by them; each scheduler uses its own consumer group and only trusts weights of its own
(unique) model name.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from shared import topics
from shared.kafka import send
from shared.schemas import (
    DeadLetter, DecodeError, decode, GroupDropped, Metrics, RewardEvent, RolloutRequest, WeightUpdate,
)

pytestmark = pytest.mark.kafka


async def collect(consumer, cls, keep, want: int, timeout_s: float = 20.0, settle_s: float = 0.0) -> list:
    """Decode records of ``cls`` for which ``keep(record)`` holds until ``want`` are seen (or the deadline).

    With ``settle_s`` it keeps reading that long after ``want`` were seen (to catch extra records).
    Undecodable records (other tests' garbage) are skipped.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    out: list = []
    while loop.time() < deadline:
        batch = await consumer.getmany(timeout_ms=100)
        for msgs in batch.values():
            for m in msgs:
                try:
                    rec = decode(m.value, cls)
                except DecodeError:
                    continue
                if keep(rec):
                    out.append(rec)
        if len(out) >= want:
            deadline = min(deadline, loop.time() + settle_s)
            if settle_s == 0:
                break
    return out


async def wait_for(pred, timeout_s: float = 20.0, interval_s: float = 0.05):
    """Poll ``pred()`` (sync) until it returns a truthy value; that value, or None at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        v = pred()
        if v:
            return v
        await asyncio.sleep(interval_s)
    return None



def _reward(req: RolloutRequest, i: int, passed: bool, v: int = 0) -> RewardEvent:
    return RewardEvent(task_id=req.task.task_id, group_id=req.group_id, trajectory_id=f"{req.group_id}:{req.attempt}:{i}",
                       sample_index=i, group_size=req.n, domain=req.task.domain, difficulty=req.task.difficulty,
                       purpose=req.purpose, attempt=req.attempt, eval_round=req.eval_round, reward=float(passed),
                       passed=passed, completion_tokens=4, finish_reason="stop", policy_version=v)


async def _produce(producer, topic: str, record, key: str) -> None:
    await (await send(producer, topic, record, key))


def _cfg(make_config, kafka_cfg, unique, resample_unsolved: int = 0, **sched):
    s = {"poll_interval_s": 0.05, "consumer_group": f"sched-{unique}", "weights_model": f"m-{unique}",
         "eval_before_training": False}
    s.update(sched)
    return make_config(kafka=kafka_cfg, scheduler=s, budget={"batch_groups": 1, "max_staleness": 0, "max_steps": 30,
                                                             "resample_unsolved": resample_unsolved})


async def test_records_and_rest_changes_wake_the_issue_loop(make_config, kafka_cfg, unique, running, task, kafka_io):
    """With a 10 s timed pass (an idle scheduler's cost), new tasks over REST and a new weight version are still
    answered within seconds: each wakes the issue loop."""
    producer, reader = kafka_io
    ids = [f"{unique}-w{i}" for i in range(2)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in ids  # noqa: E731
    async with running(_cfg(make_config, kafka_cfg, unique, poll_interval_s=10.0)) as (client, state):
        await asyncio.sleep(0.5)  # the loop's first pass is done: it naps now
        t0 = time.monotonic()
        assert (await client.post("/v1/tasks", json={"tasks": [task(t) for t in ids]})).status_code == 202
        first = await collect(requests, RolloutRequest, mine, want=1, timeout_s=4.0)
        assert len(first) == 1 and time.monotonic() - t0 < 4.0
        for i in range(first[0].n):  # the group completes: its in-flight place is free
            await _produce(producer, topics.REWARDS, _reward(first[0], i, i == 0), first[0].task.task_id)
        assert await wait_for(lambda: state.registry.get_group(first[0].group_id)["state"] == "complete")
        t0 = time.monotonic()
        wu = WeightUpdate(model=f"m-{unique}", version=1, step=1, manifest=[], checksum="sha256:x", path="/x")
        await _produce(producer, topics.WEIGHTS, wu, wu.model)
        second = await collect(requests, RolloutRequest, mine, want=1, timeout_s=4.0)
        assert len(second) == 1 and second[0].group_id != first[0].group_id and time.monotonic() - t0 < 4.0


async def test_flow_control_rewards_weights_and_dlq(make_config, kafka_cfg, unique, running, task, kafka_io):
    producer, reader = kafka_io
    ids = [f"{unique}-t{i}" for i in range(3)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in ids  # noqa: E731
    async with running(_cfg(make_config, kafka_cfg, unique)) as (client, state):
        r = await client.post("/v1/tasks", json={"tasks": [task(t) for t in ids]})
        assert r.status_code == 202

        # (v + η + 1) * B = (0 + 0 + 1) * 1: exactly one group, even after a while.
        first = await collect(requests, RolloutRequest, mine, want=1, settle_s=1.5)
        assert len(first) == 1, first
        req = first[0]
        assert (req.n, req.purpose, req.attempt, req.min_policy_version) == (2, "train", 1, 0)
        assert req.sampling.temperature == 1.0 and req.group_id == f"{req.task.task_id}:0"
        assert state.registry.train_group_counts() == (1, 1)

        # A malformed reward record goes to the DLQ; the events behind it (same partition) still count.
        await producer.send_and_wait(topics.REWARDS, b"{not json", key=req.task.task_id.encode())
        for i, passed in enumerate([True, False]):
            await _produce(producer, topics.REWARDS, _reward(req, i, passed), req.task.task_id)
        await _produce(producer, topics.REWARDS, _reward(req, 0, True), req.task.task_id)  # redelivery

        done = await wait_for(lambda: state.registry.get_group(req.group_id)["state"] == "complete")
        assert done, state.registry.get_group(req.group_id)
        t = (await client.get(f"/v1/tasks/{req.task.task_id}")).json()
        assert (t["samples"], t["passes"], t["pass_rate"], t["groups_issued"]) == (2, 1, 0.5, 1)
        dlq = await reader(topics.DLQ)
        dead = await collect(dlq, DeadLetter, lambda d: d.source_topic == topics.REWARDS
                             and d.payload == "{not json" and d.consumer == "scheduler", want=1)
        assert dead and "not JSON" in dead[0].reason

        # Still at v = 0: the total cap holds the second group back.
        more = await collect(requests, RolloutRequest, mine, want=1, timeout_s=1.0)
        assert more == []

        wu = WeightUpdate(model=f"m-{unique}", version=1, step=1, manifest=[], checksum="sha256:x", path="/x")
        await _produce(producer, topics.WEIGHTS, wu, wu.model)
        step = 10_000 + int(unique, 16) % 1_000_000
        await _produce(producer, topics.METRICS,
                       Metrics(source="trainer", step=step, policy_version=1, values={"loss/total": 0.25}), "trainer")
        second = await collect(requests, RolloutRequest, mine, want=1)
        assert len(second) == 1 and second[0].group_id != req.group_id
        assert second[0].task.task_id != req.task.task_id  # fewest groups issued first

        st = (await client.get("/v1/status")).json()
        assert st["policy_version"] == 1 and st["completed_groups"] == 1 and st["in_flight_groups"] == 1
        assert st["samples_scored"] == 2 and st["train_reward_mean"] == 0.5
        assert st["staleness"] == {"mean": 0.0, "max": 0.0} and st["throughput_samples_per_s"] > 0
        hist = await wait_for(lambda: [h for h in state.stats.history() if h["step"] == step])
        assert hist and hist[0]["values"] == {"loss/total": 0.25}
        got = (await client.get("/v1/metrics/history")).json()
        assert any(h["step"] == step for h in got) and [h["step"] for h in got] == sorted(h["step"] for h in got)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10  # shutdown is bounded
    assert state.sampler._task is None


async def test_eval_before_training_then_rest_eval_round(make_config, kafka_cfg, unique, running, task, kafka_io):
    producer, reader = kafka_io
    train_id, eval_ids = f"{unique}-tr", [f"{unique}-e{i}" for i in range(2)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in (train_id, *eval_ids)  # noqa: E731
    # at_once: round 1 is asked for while the training group is in flight (slack timing: the next test)
    async with running(_cfg(make_config, kafka_cfg, unique, eval_before_training=True,
                            eval_timing="at_once")) as (client, state):
        body = {"tasks": [task(train_id)] + [task(e, split="eval") for e in eval_ids]}
        assert (await client.post("/v1/tasks", json=body)).status_code == 202

        evals = await collect(requests, RolloutRequest, mine, want=2, settle_s=1.0)
        assert sorted(r.task.task_id for r in evals) == eval_ids, evals  # no training request yet
        assert all(r.purpose == "eval" and r.n == 1 and r.sampling.temperature == 0.0 and r.eval_round == 0
                   for r in evals)
        for r, passed in zip(evals, [True, False]):
            await _produce(producer, topics.REWARDS, _reward(r, 0, passed, v=0), r.task.task_id)
        train = await collect(requests, RolloutRequest, mine, want=1)
        assert [r.purpose for r in train] == ["train"] and train[0].task.task_id == train_id
        r0 = (await client.get("/v1/evals/0")).json()
        assert (r0["n"], r0["completed"], r0["correct"], r0["accuracy"], r0["done"]) == (2, 2, 1, 0.5, True)
        assert r0["policy_versions"] == [0] and r0["min_policy_version"] == 0

        resp = await client.post("/v1/evals", json={"min_policy_version": 2})
        assert resp.status_code == 202 and resp.json() == {"eval_round": 1}
        again = await collect(requests, RolloutRequest, lambda r: mine(r) and r.eval_round == 1, want=2)
        assert len(again) == 2 and all(r.min_policy_version == 2 and r.sampling.temperature == 0 for r in again)
        for r in again:
            await _produce(producer, topics.REWARDS, _reward(r, 0, True, v=2), r.task.task_id)
        r1 = await wait_for(lambda: (s := state.registry.eval_round(1))["done"] and s)
        assert r1 and r1["accuracy"] == 1.0 and r1["policy_versions"] == [2]
        listed = (await client.get("/v1/evals")).json()
        assert [e["eval_round"] for e in listed] == [0, 1]
        assert [e["accuracy"] for e in (await client.get("/v1/status")).json()["evals"]] == [0.5, 1.0]


@pytest.mark.e2e  # 8-14 s of broker round trips: the e2e tier keeps the default one within ten minutes
async def test_eval_groups_fill_the_rollouts_slack_in_chunks(make_config, kafka_cfg, unique, running, task,
                                                              kafka_io):
    """``eval_timing: slack``: an eval round asked for while a training group is in flight waits; once nothing
    is in flight a chunk of ``eval_chunk_groups`` goes, the next chunk once that one is answered."""
    producer, reader = kafka_io
    train_ids, eval_ids = [f"{unique}-tr{i}" for i in range(3)], [f"{unique}-e{i}" for i in range(5)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in (*train_ids, *eval_ids)  # noqa: E731
    evals = lambda r: mine(r) and r.purpose == "eval"  # noqa: E731
    cfg = _cfg(make_config, kafka_cfg, unique, eval_timing="slack", eval_chunk_groups=2, eval_max_wait_s=300.0)
    async with running(cfg) as (client, state):
        body = {"tasks": [task(t) for t in train_ids] + [task(e, split="eval") for e in eval_ids]}
        assert (await client.post("/v1/tasks", json=body)).status_code == 202
        (train,) = await collect(requests, RolloutRequest, mine, want=1, settle_s=0.5)
        assert train.purpose == "train"
        assert (await client.post("/v1/evals", json={"min_policy_version": 0})).json() == {"eval_round": 0}
        assert await collect(requests, RolloutRequest, evals, want=1, timeout_s=1.5) == []  # training in flight
        for i in range(train.n):
            await _produce(producer, topics.REWARDS, _reward(train, i, i == 0), train.task.task_id)
        seen: set[str] = set()
        for want in (2, 2, 1):  # one chunk at a time, the next once it is answered
            chunk = await collect(requests, RolloutRequest, evals, want=want, settle_s=1.0)
            assert len(chunk) == want and not {r.group_id for r in chunk} & seen, (want, chunk)
            seen |= {r.group_id for r in chunk}
            for r in chunk:
                await _produce(producer, topics.REWARDS, _reward(r, 0, True), r.task.task_id)
        assert len(seen) == 5 and await wait_for(lambda: state.registry.eval_round(0)["done"])


async def test_an_eval_round_that_waited_its_longest_goes_whole(make_config, kafka_cfg, unique, running, task,
                                                                kafka_io):
    """``eval_timing: slack`` with a training group in flight that is never answered: the round goes whole once
    it waited ``eval_max_wait_s``."""
    producer, reader = kafka_io
    train_id, eval_ids = f"{unique}-tr", [f"{unique}-e{i}" for i in range(5)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in (train_id, *eval_ids)  # noqa: E731
    cfg = _cfg(make_config, kafka_cfg, unique, eval_timing="slack", eval_chunk_groups=2, eval_max_wait_s=3.0)
    async with running(cfg) as (client, state):
        body = {"tasks": [task(train_id)] + [task(e, split="eval") for e in eval_ids]}
        assert (await client.post("/v1/tasks", json=body)).status_code == 202
        assert await collect(requests, RolloutRequest, lambda r: mine(r) and r.purpose == "train", want=1)
        t0 = time.monotonic()
        assert (await client.post("/v1/evals", json={"min_policy_version": 0})).json() == {"eval_round": 0}
        late = await collect(requests, RolloutRequest, lambda r: mine(r) and r.purpose == "eval", want=5)
        waited = time.monotonic() - t0
        assert len(late) == 5 and waited >= 2.5, (len(late), waited)
        assert state.registry.train_group_counts()[1] == 1  # the training group is still in flight


async def test_deadline_reissues_same_group_then_abandons(make_config, kafka_cfg, unique, running, task, kafka_io):
    _, reader = kafka_io
    tid = f"{unique}-slow"
    requests = await reader(topics.ROLLOUT_REQUESTS)
    cfg = _cfg(make_config, kafka_cfg, unique, group_deadline_s=0.5, max_attempts=2)
    async with running(cfg) as (client, state):
        assert (await client.post("/v1/tasks", json={"tasks": [task(tid)]})).status_code == 202
        seen = await collect(requests, RolloutRequest, lambda r: r.task.task_id == tid, want=3)
        assert [(r.group_id, r.attempt) for r in seen] == [(f"{tid}:0", 1), (f"{tid}:0", 2), (f"{tid}:1", 1)]
        st = (await client.get("/v1/status")).json()
        assert st["abandoned_groups"] >= 1
        assert state.registry.get_group(f"{tid}:0")["state"] == "abandoned"


async def test_oversample_issues_more_groups_per_step(make_config, kafka_cfg, unique, running, task, kafka_io):
    """B = 2, oversample 1.5, η = 0: ⌈2 · 1.5⌉ = 3 groups at policy version 0, not 2."""
    _, reader = kafka_io
    ids = [f"{unique}-t{i}" for i in range(5)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    cfg = make_config(kafka=kafka_cfg, scheduler={"poll_interval_s": 0.05, "consumer_group": f"sched-{unique}",
                                                   "weights_model": f"m-{unique}", "eval_before_training": False},
                      budget={"batch_groups": 2, "max_staleness": 0, "max_steps": 30, "oversample": 1.5})
    async with running(cfg) as (client, state):
        assert (await client.post("/v1/tasks", json={"tasks": [task(t) for t in ids]})).status_code == 202
        got = await collect(requests, RolloutRequest, lambda r: r.task.task_id in ids, want=3, settle_s=1.5)
        assert len(got) == 3, got
        assert state.registry.train_group_counts() == (3, 3)


async def test_a_misconfigured_reward_pauses_its_domain_until_resumed(make_config, kafka_cfg, unique, running, task,
                                                                      kafka_io):
    producer, reader = kafka_io
    dom = f"broken-{unique}"
    ids = [f"{unique}-b{i}" for i in range(3)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in ids  # noqa: E731
    async with running(_cfg(make_config, kafka_cfg, unique)) as (client, state):  # one group per policy version
        assert (await client.post("/v1/tasks", json={"tasks": [task(t, domain=dom) for t in ids]})).status_code == 202
        (req,) = await collect(requests, RolloutRequest, mine, want=1, settle_s=0.5)
        ev = _reward(req, 0, False).model_copy(update={"infra_error": True, "misconfigured": True,
                                                       "reason": "gold answer '∞∞' does not parse"})
        await _produce(producer, topics.REWARDS, ev, req.task.task_id)
        await _produce(producer, topics.REWARDS, _reward(req, 1, False), req.task.task_id)  # the group completes
        assert await wait_for(lambda: dom in state.registry.paused_domains())
        st = (await client.get("/v1/status")).json()
        assert st["paused_domains"] == {dom: "gold answer '∞∞' does not parse"}
        # a new policy version opens the budget for one more group, but the domain is paused
        wu = WeightUpdate(model=f"m-{unique}", version=1, step=1, manifest=[], checksum="sha256:x", path="/x")
        await _produce(producer, topics.WEIGHTS, wu, wu.model)
        assert await wait_for(lambda: state.registry.policy_version == 1)
        assert await collect(requests, RolloutRequest, mine, want=1, timeout_s=1.5) == [], "paused, yet issued"
        assert (await client.post("/v1/domains/nope/resume")).status_code == 404
        r = await client.post(f"/v1/domains/{dom}/resume")
        assert r.status_code == 200 and r.json() == {"domain": dom, "state": "resumed"}
        assert len(await collect(requests, RolloutRequest, mine, want=1)) == 1, "no group after the resume"


@pytest.mark.e2e  # 8-14 s of broker round trips: the e2e tier keeps the default one within ten minutes
async def test_an_unsolved_group_is_resampled_with_more_samples(make_config, kafka_cfg, unique, running, task,
                                                                 kafka_io):
    """``resample_unsolved: 6``: a group whose K = 2 samples all fail is followed at once by one group of 6
    samples of the same task, beyond the issue budget (still one group per policy version); a solved
    group and the re-sample itself get none."""
    producer, reader = kafka_io
    ids = [f"{unique}-t{i}" for i in range(3)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in ids  # noqa: E731
    cfg = _cfg(make_config, kafka_cfg, unique, resample_unsolved=6)
    cfg.budget.max_staleness = 1  # room in flight for the re-sample: (η + 1) · B = 2
    async with running(cfg) as (client, state):
        assert (await client.post("/v1/tasks", json={"tasks": [task(t) for t in ids]})).status_code == 202
        first = await collect(requests, RolloutRequest, mine, want=2, settle_s=1.0)  # (0 + 1 + 1) · 1
        assert len(first) == 2 and all(r.n == 2 for r in first), first
        unsolved, solved = first
        for i in range(2):
            await _produce(producer, topics.REWARDS, _reward(unsolved, i, False), unsolved.task.task_id)
            await _produce(producer, topics.REWARDS, _reward(solved, i, i == 0), solved.task.task_id)
        (extra,) = await collect(requests, RolloutRequest, mine, want=1, settle_s=1.5)
        assert (extra.task.task_id, extra.n, extra.purpose) == (unsolved.task.task_id, 6, "train")
        assert state.registry.get_group(extra.group_id)["resample_of"] == unsolved.group_id
        assert state.registry.train_group_counts() == (2, 1)
        for i in range(6):  # the re-sample fails too: nothing more
            await _produce(producer, topics.REWARDS, _reward(extra, i, False), extra.task.task_id)
        assert await wait_for(lambda: state.registry.get_group(extra.group_id)["state"] == "complete")
        assert await collect(requests, RolloutRequest, mine, want=1, timeout_s=1.5) == []
        t = (await client.get(f"/v1/tasks/{unsolved.task.task_id}")).json()
        assert (t["samples"], t["passes"], t["groups_issued"]) == (8, 0, 2)


@pytest.mark.e2e  # 8-14 s of broker round trips: the e2e tier keeps the default one within ten minutes
async def test_a_group_the_trainer_drops_gives_its_slot_back(make_config, kafka_cfg, unique, running, task, kafka_io):
    """At v = 0 with η = 0 and B = 1 the budget holds one group. A completed group the trainer reports
    dropped (stale) frees its slot: a new group goes out at once, still at v = 0, and the dropped one is
    counted in the status. A repeated notice, a malformed one (to the DLQ) and one for an unknown group
    free nothing more; a dropped group past its deadline is not re-issued."""
    producer, reader = kafka_io
    ids = [f"{unique}-t{i}" for i in range(3)]
    requests = await reader(topics.ROLLOUT_REQUESTS)
    mine = lambda r: r.task.task_id in ids  # noqa: E731
    cfg = _cfg(make_config, kafka_cfg, unique, group_deadline_s=6.0)
    async with running(cfg) as (client, state):
        assert (await client.post("/v1/tasks", json={"tasks": [task(t) for t in ids]})).status_code == 202
        (first,) = await collect(requests, RolloutRequest, mine, want=1, settle_s=1.0)
        for i in range(2):
            await _produce(producer, topics.REWARDS, _reward(first, i, i == 0), first.task.task_id)
        assert await wait_for(lambda: state.registry.get_group(first.group_id)["state"] == "complete")
        assert await collect(requests, RolloutRequest, mine, want=1, timeout_s=1.0) == []  # budget spent

        drop = GroupDropped(group_id=first.group_id, reason="stale", policy_version=0, behaviour_version=0, samples=2)
        await producer.send_and_wait(topics.GROUP_DROPS, b"{not json", key=first.group_id.encode())
        await _produce(producer, topics.GROUP_DROPS, drop, first.group_id)
        await _produce(producer, topics.GROUP_DROPS, drop, first.group_id)  # redelivery
        await _produce(producer, topics.GROUP_DROPS, drop.model_copy(update={"group_id": f"{unique}-nope:0"}),
                       f"{unique}-nope:0")
        (second,) = await collect(requests, RolloutRequest, mine, want=1, settle_s=1.5)
        assert second.group_id != first.group_id and second.task.task_id != first.task.task_id
        assert state.registry.get_group(first.group_id)["dropped"] == "stale"
        assert state.registry.train_group_counts() == (1, 1)
        st = (await client.get("/v1/status")).json()
        assert st["dropped_groups"] == {"stale": 1} and st["policy_version"] == 0
        dlq = await reader(topics.DLQ)
        assert await collect(dlq, DeadLetter, lambda d: d.source_topic == topics.GROUP_DROPS
                             and d.payload == "{not json" and d.consumer == "scheduler", want=1)

        # the trainer dropped the second group while in flight (a failed sample): its slot comes back at
        # once (it no longer counts in flight either), and when its deadline passes it is not re-issued
        fail = GroupDropped(group_id=second.group_id, reason="failed", policy_version=0, behaviour_version=0, samples=1)
        await _produce(producer, topics.GROUP_DROPS, fail, second.group_id)
        (third,) = await collect(requests, RolloutRequest, mine, want=1, timeout_s=3.0, settle_s=1.0)
        assert third.group_id not in (first.group_id, second.group_id)
        assert await wait_for(lambda: state.registry.get_group(second.group_id)["state"] == "abandoned", 10.0)
        assert [r.group_id for r in await collect(requests, RolloutRequest, mine, want=1, timeout_s=1.0)] == []
        assert (await client.get("/v1/status")).json()["dropped_groups"] == {"stale": 1, "failed": 1}


@pytest.mark.e2e  # 8-14 s of broker round trips: the e2e tier keeps the default one within ten minutes
async def test_alerts_breaker_and_control_round_trip_through_the_broker(make_config, kafka_cfg, unique, running, task,
                                                                        kafka_io):
    """A domain whose scorer starts crediting everything trips its breaker: the alerts come out on
    flywheel.alerts, the breaker's ``domain_state`` on flywheel.control, and no group of the domain is issued
    until an operator's ``close_breaker`` record (sent on flywheel.control by a plain Kafka client) closes
    it. A malformed control record goes to the DLQ and changes nothing."""
    from shared.schemas import Alert, Control

    producer, reader = kafka_io
    dom = f"judged-{unique}"
    ids = [f"{unique}-j{i}" for i in range(4)]
    cfg = _cfg(make_config, kafka_cfg, unique)
    cfg.monitor = cfg.monitor.model_copy(update={"window": 8, "reference": 8, "min_samples": 8})
    cfg.budget.max_staleness = 8
    requests = await reader(topics.ROLLOUT_REQUESTS)
    alerts = await reader(topics.ALERTS)
    controls = await reader(topics.CONTROL)
    mine = lambda r: r.task.domain == dom  # noqa: E731
    async with running(cfg) as (client, state):
        await asyncio.wait_for(state.sampler.guard.control_ready.wait(), 30)
        r = await client.post("/v1/tasks", json={"tasks": [task(t, domain=dom, samples_per_task=4) for t in ids]})
        assert r.status_code == 202
        backlog: list[RolloutRequest] = []

        async def answer(n_groups, credit_all):
            if len(backlog) < n_groups:
                backlog.extend(await collect(requests, RolloutRequest, mine, want=n_groups - len(backlog), timeout_s=20))
            assert len(backlog) >= n_groups, backlog
            for req in backlog[:n_groups]:
                for i in range(req.n):
                    ans = ["a", "b", "c", "d"][i]
                    ev = _reward(req, i, credit_all or ans == "a").model_copy(update={"completion_hash": ans})
                    await _produce(producer, topics.REWARDS, ev, req.task.task_id)
            del backlog[:n_groups]

        await answer(4, False)  # 16 honest samples: the reference and a first window
        await answer(3, True)
        tripped = await wait_for(lambda: state.sampler.guard.monitor.breaker(dom).state == "open", 20)
        assert tripped, state.sampler.guard.monitor.active
        got = await collect(alerts, Alert, lambda a: a.domain == dom, want=2, timeout_s=20, settle_s=0.5)
        kinds = {(a.signal, a.severity, a.status) for a in got}
        assert ("breaker", "critical", "firing") in kinds, kinds
        assert {("scorer_inconsistency", "critical", "firing"), ("pass_rate_jump", "critical", "firing")} & kinds, kinds
        ds = await collect(controls, Control, lambda c: c.domain == dom and c.command == "domain_state"
                           and c.trainable is False, want=1)
        assert ds and ds[0].reason == "circuit_open" and ds[0].origin == "scheduler"
        view = (await client.get(f"/v1/domains/{dom}")).json()
        assert view["breaker"]["state"] == "open"
        assert view["breaker"]["signal"] in ("scorer_inconsistency", "pass_rate_jump"), view["breaker"]
        st = (await client.get("/v1/status")).json()
        assert st["breakers"] == {dom: "open"} and st["alerts"]["critical"] >= 1
        listed = (await client.get("/v1/alerts", params={"domain": dom})).json()
        assert any(a["signal"] == "breaker" for a in listed["active"]) and listed["recent"]

        # open: nothing more of the domain is issued (cool-down 60 s by default), even with slots free
        issued_at_trip = state.registry.train_group_counts()[0]
        wu = WeightUpdate(model=f"m-{unique}", version=5, step=5, manifest=[], checksum="sha256:x", path="/x")
        await _produce(producer, topics.WEIGHTS, wu, wu.model)
        assert await wait_for(lambda: state.registry.policy_version == 5, 20)
        await asyncio.sleep(1.5)
        assert state.registry.train_group_counts()[0] == issued_at_trip

        # a malformed control record and a refused one change nothing; both go to the DLQ / the log
        await producer.send_and_wait(topics.CONTROL, b"{not json", key=dom.encode())
        bad = orjson.dumps({"schema": "flywheel.Control", "schema_version": 1, "command": "explode", "domain": dom})
        await producer.send_and_wait(topics.CONTROL, bad, key=dom.encode())
        dlq = await reader(topics.DLQ)
        dead = await collect(dlq, DeadLetter, lambda d: d.source_topic == topics.CONTROL and dom in d.payload
                             or d.payload == "{not json" and d.source_topic == topics.CONTROL, want=2, timeout_s=20)
        assert len(dead) >= 2 and {d.consumer for d in dead} == {"scheduler"}
        assert state.sampler.guard.monitor.breaker(dom).state == "open"

        # an operator closes it over Kafka: issuing resumes
        await _produce(producer, topics.CONTROL, Control(command="close_breaker", domain=dom, origin="cli"), dom)
        closed = await wait_for(lambda: state.sampler.guard.monitor.breaker(dom).state == "closed", 20)
        assert closed
        ds = await collect(controls, Control, lambda c: c.domain == dom and c.command == "domain_state"
                           and c.trainable is True, want=1)
        assert ds
        got = await collect(alerts, Alert, lambda a: a.domain == dom and a.signal == "breaker"
                            and a.status == "resolved", want=1, timeout_s=20)
        assert got and got[0].details["state"] == "closed"
        assert await wait_for(lambda: state.registry.train_group_counts()[0] > issued_at_trip, 20)

        # REST control: a threshold override and a run-wide training pause
        r = await client.post("/v1/control", json={"command": "set_threshold", "domain": dom,
                                                   "signal": "truncation_rate", "threshold": {"critical": 0.9}})
        assert r.status_code == 200 and r.json()["thresholds"]["critical"] == 0.9
        assert state.registry.domain(dom).config.monitor == {"truncation_rate": {"critical": 0.9}}
        r = await client.post("/v1/control", json={"command": "set_threshold", "signal": "nope", "threshold": {"x": 1}})
        assert r.status_code == 422 and "threshold" in str(r.json())
        r = await client.post("/v1/control", json={"command": "open_breaker"})
        assert r.status_code == 422 and "domain" in str(r.json())
        r = await client.post("/v1/control", json={"command": "open_breaker", "domain": f"none-{unique}"})
        assert r.status_code == 404
        r = await client.post("/v1/training/pause", params={"reason": "inspecting"})
        assert r.status_code == 200 and state.sampler.training_allowed() is False
        assert (await client.get("/v1/status")).json()["training_paused"]["reason"] == "inspecting"
        pub = await collect(controls, Control, lambda c: c.command == "pause_training" and c.origin == "rest"
                            and c.reason == "inspecting", want=1)
        assert pub
        r = await client.post("/v1/training/resume")
        assert r.status_code == 200 and state.sampler.training_allowed() is True


async def test_an_eval_group_whose_request_can_never_be_produced_is_abandoned_with_the_reason(
        make_config, kafka_cfg, unique, running, task):
    """An eval round whose send fails was left ``issued`` for 3 × group_deadline_s. A request
    larger than the producer's limit (``kafka.max_request_size``) can never be sent: its group is abandoned at
    once with the reason, the round finishes, and the small item of the same round is sent as usual."""
    from shared.config import KafkaConfig
    from shared.schemas import Task

    kafka = KafkaConfig(bootstrap_servers=kafka_cfg.bootstrap_servers, partitions=kafka_cfg.partitions,
                        max_request_size=4096)
    small, big = f"{unique}-small", f"{unique}-big"
    cfg = _cfg(make_config, kafka, unique, group_deadline_s=600)
    async with running(cfg) as (client, state):
        reg = state.registry
        reg.register_tasks([Task.model_validate({**task(small, split="eval"), "task_id": small}),
                            Task.model_validate({**task(big, split="eval", prompt=[{"role": "user",
                                                                                   "content": "x" * 20000}]),
                                                 "task_id": big})])
        rid = reg.create_eval_round(0)
        row = await wait_for(lambda: (g := reg.get_group(f"{big}:0")) and g["state"] == "abandoned" and g, 10)
        assert row, reg.get_group(f"{big}:0")
        assert "MessageSizeTooLargeError" in row["abandon_reason"], row
        assert reg.get_group(f"{small}:0")["state"] == "issued"
        r = reg.eval_round(rid)
        assert r["abandoned"] == 1 and not r["done"]  # only the small item's reward is outstanding
