"""The scheduler across a restart of its (memory-storage) broker: a private Tansu per test, killed with -9 and
started again empty on the same port.

Checked: the sampler notices by itself (its marker topic is gone) and re-issues the in-flight group at once,
with a free attempt (``max_attempts`` not used up: with 2 the group still gets its deadline re-issue); its consumers start over on the new broker (rewards
complete the group, a weight version at offset 0 of the new topic raises the policy version); the
supervisor's notice ``POST /v1/system/broker-restarted`` does the same, once per restart; a send that fails
while the broker is down puts its group back to ``pending`` (never left ``issued`` until the deadline) and it
goes out once the broker is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from flywheel.broker import EmbeddedBroker
from scheduler_service import sampler as sampler_mod
from shared import topics
from shared.auth import auth_headers, read_token
from shared.config import KafkaConfig
from shared.kafka import ensure_topics, make_consumer, make_producer, send
from shared.schemas import DecodeError, RewardEvent, RolloutRequest, WeightUpdate, decode

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]  # kills the broker: the e2e tier


def _kafka(broker: EmbeddedBroker) -> KafkaConfig:
    fields = {"bootstrap_servers": broker.bootstrap_servers, "partitions": 2}
    if "request_timeout_ms" in KafkaConfig.model_fields:  # a send to a dead broker fails within seconds
        fields["request_timeout_ms"] = 8000  # above Tansu's ~5 s group join
    return KafkaConfig(**fields)


async def _requests(cfg: KafkaConfig, keep, want: int, timeout_s: float) -> list[RolloutRequest]:
    """RolloutRequests passing ``keep`` read from the earliest offset until ``want`` are seen or the timeout."""
    c = make_consumer(cfg, topics.ROLLOUT_REQUESTS, group_id=None, client_id="test-reader")
    await c.start()
    out, deadline = [], time.monotonic() + timeout_s
    try:
        while len(out) < want and time.monotonic() < deadline:
            for msgs in (await c.getmany(timeout_ms=100)).values():
                for m in msgs:
                    try:
                        r = decode(m.value, RolloutRequest)
                    except DecodeError:
                        continue
                    if keep(r):
                        out.append(r)
    finally:
        await c.stop()
    return out


async def _produce(cfg: KafkaConfig, *records: tuple[str, object, str]) -> None:
    p = make_producer(cfg, client_id="test")
    await p.start()
    try:
        for topic, rec, key in records:
            await (await send(p, topic, rec, key))
    finally:
        await p.stop()


def _reward(req: RolloutRequest, i: int) -> RewardEvent:
    return RewardEvent(task_id=req.task.task_id, group_id=req.group_id, trajectory_id=f"{req.group_id}:{req.attempt}:{i}",
                       sample_index=i, group_size=req.n, domain=req.task.domain, difficulty=req.task.difficulty,
                       purpose=req.purpose, attempt=req.attempt, eval_round=req.eval_round, reward=1.0, passed=True,
                       completion_tokens=4, finish_reason="stop", policy_version=0)


async def _wait(pred, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        await asyncio.sleep(0.05)
    return None


def _config(make_config, kafka: KafkaConfig, unique: str, **sched):
    s = {"poll_interval_s": 0.05, "consumer_group": f"sched-{unique}", "weights_model": f"m-{unique}",
         "eval_before_training": False, "max_attempts": 1}
    s.update(sched)
    return make_config(kafka=kafka, scheduler=s, budget={"batch_groups": 1, "max_staleness": 0, "max_steps": 30})


async def test_the_sampler_notices_an_empty_broker_and_reissues_in_flight_groups_at_once(
        make_config, unique, running, task, private_broker):
    broker, restart = private_broker
    kafka = _kafka(broker)
    await ensure_topics(kafka)
    tid = f"{unique}-t"
    model = f"m-{unique}"
    cfg = _config(make_config, kafka, unique, max_attempts=2, group_deadline_s=20)
    async with running(cfg) as (client, state):
        state.registry.register_tasks([_task(task, tid)])
        (first,) = await _requests(kafka, lambda r: r.task.task_id == tid, 1, 20)
        assert first.attempt == 1
        # three weight versions: the watch consumer's position on flywheel.weights is now 3
        await _produce(kafka, *[(topics.WEIGHTS, WeightUpdate(model=model, version=v, step=v, manifest=[],
                                                              checksum="sha256:x", path="/x"), model) for v in (1, 2, 3)])
        assert await _wait(lambda: state.registry.policy_version == 3, 20)
        issued = state.registry.train_group_counts()

        restart()
        t0 = time.monotonic()
        again = await _requests(kafka, lambda r: r.group_id == first.group_id, 1,
                                sampler_mod.BROKER_CHECK_INTERVAL_S + 25)
        took = time.monotonic() - t0
        assert again and again[0].attempt == 2, "in-flight group not re-issued after the broker restart"
        print(f"broker restart -> group re-issued by the sampler itself: {took:.1f} s")
        assert took < sampler_mod.BROKER_CHECK_INTERVAL_S + 5  # well before the 20 s deadline would
        row = state.registry.get_group(first.group_id)
        assert (row["state"], row["attempt"], row["free_attempts"]) == ("issued", 2, 1)
        assert state.registry.train_group_counts() == issued  # a re-issue is not a new group
        # max_attempts = 2: the free attempt leaves the group its deadline re-issue (attempt 3), not abandoned
        late = await _requests(kafka, lambda r: r.group_id == first.group_id and r.attempt == 3, 1, 40)
        assert late, state.registry.get_group(first.group_id)
        assert set(topics.ALL) | {sampler_mod.MARKER_TOPIC} <= await _topic_names(kafka)

        # the consumers start over on the new broker: rewards count, and version 4 at offset 0 is seen
        req = late[0]
        await _produce(kafka, *[(topics.REWARDS, _reward(req, i), tid) for i in range(req.n)],
                       (topics.WEIGHTS, WeightUpdate(model=model, version=4, step=4, manifest=[], checksum="sha256:x",
                                                     path="/x"), model))
        assert await _wait(lambda: state.registry.get_group(first.group_id)["state"] == "complete", 60)
        assert await _wait(lambda: state.registry.policy_version == 4, 30), "the watch consumer skipped offset 0"


async def test_the_supervisors_notice_reissues_once_per_restart(make_config, unique, running, task, private_broker):
    broker, restart = private_broker
    kafka = _kafka(broker)
    await ensure_topics(kafka)
    tid = f"{unique}-t"
    cfg = _config(make_config, kafka, unique)
    async with running(cfg) as (client, state):
        headers = auth_headers(read_token(cfg.auth, cfg.run))  # the client sends it anyway; explicit here
        state.registry.register_tasks([_task(task, tid)])
        (first,) = await _requests(kafka, lambda r: r.task.task_id == tid, 1, 20)
        restarted_at = time.time()
        restart()
        r = await client.post("/v1/system/broker-restarted", json={"restarted_at": restarted_at}, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["reissued"] in (0, 1)  # 0 when the sampler's own check was quicker
        r2 = await client.post("/v1/system/broker-restarted", json={"restarted_at": restarted_at}, headers=headers)
        assert r2.status_code == 200 and r2.json()["reissued"] == 0, r2.text
        got = await _requests(kafka, lambda r: r.group_id == first.group_id, 2, sampler_mod.BROKER_CHECK_INTERVAL_S + 3)
        assert [g.attempt for g in got] == [2], got  # exactly one re-issue, at once
        wrong = {"Authorization": "Bearer not-the-token"}
        assert (await client.post("/v1/system/broker-restarted", json={}, headers=wrong)).status_code == 401


async def test_a_send_that_fails_while_the_broker_is_down_releases_the_group_until_it_is_back(
        make_config, unique, running, task, private_broker):
    """An eval round created while the broker is down: its sends fail, its rows go back to ``pending`` with a
    retry time (the old sampler left them ``issued`` for group_deadline_s, 600 s here); once the broker is back
    they are sent and the round completes."""
    broker, restart = private_broker
    kafka = _kafka(broker)
    await ensure_topics(kafka)
    eids = [f"{unique}-e{i}" for i in range(2)]
    cfg = _config(make_config, kafka, unique, group_deadline_s=600)
    async with running(cfg) as (client, state):
        reg = state.registry
        reg.register_tasks([_task(task, e, split="eval") for e in eids])
        await asyncio.sleep(1.0)
        os.kill(broker.pid, signal.SIGKILL)
        broker.process.wait(10)
        rid = reg.create_eval_round(0)

        def released():
            rows = [reg.get_group(f"{e}:0") for e in eids]
            rows = [r for r in rows if r is not None]
            return rows if rows and all(r["state"] == "pending" and r["send_failures"] >= 1 for r in rows) else None

        rows = await _wait(released, 60)
        assert rows, [reg.get_group(f"{e}:0") for e in eids]
        assert all(r["retry_at"] > r["send_failures"] for r in rows)

        restart()
        t0 = time.monotonic()
        sent = await _requests(kafka, lambda r: r.eval_round == rid and r.task.task_id in eids, 2, 40)
        assert sorted(r.task.task_id for r in sent) == eids, sent
        print(f"eval round released during the outage, sent {time.monotonic() - t0:.1f} s after the broker came back")
        await _produce(kafka, *[(topics.REWARDS, _reward(r, 0), r.task.task_id) for r in sent])
        assert await _wait(lambda: reg.eval_round(rid)["done"], 30), reg.eval_round(rid)


async def _topic_names(cfg: KafkaConfig) -> set[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


def _task(task, task_id: str, **kw):
    """A Task record from the test's task body (registered straight into the registry)."""
    from shared.schemas import Task

    return Task.model_validate({**task(task_id, **kw), "task_id": task_id})


async def test_a_restarted_scheduler_sends_again_the_groups_its_predecessor_left_unanswered(
        make_config, unique, running, task, private_broker):
    """A kill -9 of the scheduler between writing a group ``issued`` and producing its request left a group the
    broker never saw; the next process waited ``group_deadline_s`` (600 s) for it, and the run's last step with
    it (seen in CI: 2 such groups held the last step's budget). Now the first broker check of the new process
    sends every unanswered group again, same attempt; a group with a reward (surely sent) is left alone."""
    broker, _ = private_broker
    kafka = _kafka(broker)
    await ensure_topics(kafka, [*topics.ALL, sampler_mod.MARKER_TOPIC])  # the broker kept its topics
    cfg = _config(make_config, kafka, unique, group_deadline_s=600)
    from scheduler_service.registry import Registry

    ids = [f"{unique}-lost", f"{unique}-answered"]
    before = Registry.from_url(cfg.scheduler.database_url, cfg.run)  # the killed process's registry
    try:
        before.register_tasks([_task(task, t) for t in ids])
        lost, answered = (before.issue_train_groups([t], deadline_s=600)[0] for t in ids)
        before.record_reward(RewardEvent(
            task_id=ids[1], group_id=answered.group_id, trajectory_id=f"{answered.group_id}:1:0", sample_index=0,
            group_size=answered.n, domain="toy", difficulty=0.5, purpose="train", attempt=1, reward=0.0,
            passed=False, completion_tokens=4, finish_reason="stop", policy_version=0))
    finally:
        before.close()
    time.sleep(0.05)
    async with running(cfg) as (client, state):
        t0 = time.monotonic()
        got = await _requests(kafka, lambda r: r.task.task_id in ids, 2, 12)
        took = time.monotonic() - t0
        assert [(r.group_id, r.attempt) for r in got] == [(lost.group_id, 1)], got
        print(f"unanswered group sent again {took:.1f} s after the scheduler started")
        row = state.registry.get_group(lost.group_id)
        assert row["state"] == "issued" and row["attempt"] == 1 and row["deadline"] > time.time() + 500
        assert state.registry.get_group(answered.group_id)["attempt"] == 1
