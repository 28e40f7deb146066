"""The rollout service against a real broker: requests in, trajectories out, weight versions applied."""

import asyncio

import pytest
import torch

from flywheel.broker import EmbeddedBroker, free_port
from rollout_service.config import RolloutSettings
from rollout_service.main import run
from shared import kafka, topics
from shared.checkpoint import CheckpointStore
from shared.metrics import scrape, total
from shared.model import build_tiny_model, load_model
from shared.model_weights import snapshot_weights
from shared.schemas import DeadLetter, RolloutRequest, SamplingParams, Task, Trajectory
from tests.support.taught import teach_tiny_model

TASK = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "q"}],
            verifier={"kind": "regex", "pattern": "^a"})


def _settings(broker: EmbeddedBroker, model_dir, tmp_path, **rollout) -> RolloutSettings:
    """The rollout service's own settings: the tiny model, a run dir under ``tmp_path``, 2 partitions."""
    return RolloutSettings(model={"name": str(model_dir)}, run={"dir": str(tmp_path / "run")},
                           kafka={"bootstrap_servers": broker.bootstrap_servers, "partitions": 2}, rollout=rollout)


@pytest.mark.kafka
async def test_requests_become_trajectories_and_new_weights_are_used(tmp_path, read_topic):
    model_dir = build_tiny_model(tmp_path / "tiny")
    with EmbeddedBroker.start() as b:
        cfg = _settings(b, model_dir, tmp_path, max_batch_samples=8)
        cfg.telemetry.metrics_port = free_port()
        await kafka.ensure_topics(cfg.kafka)
        stop = asyncio.Event()
        service = asyncio.create_task(run(cfg, stop))
        p = kafka.make_producer(cfg.kafka)
        await p.start()
        try:
            await p.send_and_wait(topics.ROLLOUT_REQUESTS, b'{"schema": "flywheel.RolloutRequest"}', key=b"bad")
            sp = SamplingParams(max_new_tokens=4, temperature=0.8)
            await (await kafka.send(p, topics.ROLLOUT_REQUESTS,
                                    RolloutRequest(group_id="g0", task=TASK, n=3, sampling=sp), "g0"))
            trajs = await read_topic(cfg.kafka, topics.TRAJECTORIES, Trajectory, 3)
            assert sorted(t.sample_index for t in trajs) == [0, 1, 2]
            assert all(t.group_id == "g0" and t.group_size == 3 and t.behaviour_version == 0 for t in trajs)
            assert all(len(t.completion_logprobs) == len(t.completion_ids) == len(t.loss_mask) for t in trajs)
            assert all(t.temperature == 0.8 for t in trajs)  # the trainer scores at the sampling temperature
            dl = await read_topic(cfg.kafka, topics.DLQ, DeadLetter, 1)
            assert dl[0].source_topic == topics.ROLLOUT_REQUESTS and "task" in dl[0].reason

            # publish version 1 (different weights); a request that needs it waits for it and is tagged with it
            model = load_model(model_dir)
            with torch.no_grad():
                for prm in model.parameters():
                    prm.add_(0.5)
            store = CheckpointStore(cfg.run.path(cfg.run.checkpoint_dir))
            upd = store.save(snapshot_weights(model), cfg.model.name, 1, 1, None)
            await (await kafka.send(p, topics.ROLLOUT_REQUESTS, RolloutRequest(
                group_id="g1", task=TASK, n=2, sampling=SamplingParams(max_new_tokens=4, temperature=0.0),
                min_policy_version=1), "g1"))
            await asyncio.sleep(1.0)
            await (await kafka.send(p, topics.WEIGHTS, upd, upd.model))
            trajs = [t for t in await read_topic(cfg.kafka, topics.TRAJECTORIES, Trajectory, 5) if t.group_id == "g1"]
            assert len(trajs) == 2 and all(t.behaviour_version == 1 and t.temperature == 0.0 for t in trajs)
            # a prompt that cannot fit the context is refused as error samples, not generated
            long_task = TASK.model_copy(update={"prompt": [{"role": "user", "content": "x" * 600}]})
            await (await kafka.send(p, topics.ROLLOUT_REQUESTS, RolloutRequest(
                group_id="g2", task=long_task, n=2, sampling=SamplingParams(max_new_tokens=4)), "g2"))
            trajs = [t for t in await read_topic(cfg.kafka, topics.TRAJECTORIES, Trajectory, 7) if t.group_id == "g2"]
            assert [t.finish_reason for t in trajs] == ["error", "error"] and "context" in trajs[0].error
            assert service.done() is False

            # the Prometheus families saw the same run (scraped from the service's metrics port)
            m = await asyncio.to_thread(scrape, f"http://127.0.0.1:{cfg.telemetry.metrics_port}/metrics")
            toy = {lab["finish_reason"]: v for lab, v in m["flywheel_rollout_samples_total"] if lab["domain"] == "toy"}
            assert toy["error"] == 2 and sum(toy.values()) == 7
            assert total(m, "flywheel_rollout_generated_tokens_total", lambda lab: lab["domain"] == "toy") > 0
            assert total(m, "flywheel_rollout_dlq_records_total") == 1
            drops = {lab["reason"]: v for lab, v in m["flywheel_rollout_requests_dropped_total"]}
            assert drops == {"malformed": 1.0, "context_overflow": 1.0}
            assert m["flywheel_rollout_policy_version"] == [({}, 1.0)]
            assert total(m, "flywheel_rollout_weight_load_seconds_count") == 1
            assert total(m, "flywheel_rollout_generate_seconds_count") >= 2
            assert total(m, "flywheel_rollout_batch_seconds_count") >= 3
        finally:
            await p.stop()
            stop.set()
            await asyncio.wait_for(service, 30)


def test_weight_watcher_skips_versions_outside_the_store_and_keeps_the_newest_good(tmp_path):
    from rollout_service.weights import WeightWatcher
    from shared.schemas import WeightUpdate

    store = tmp_path / "ckpt"
    store.mkdir()
    w = WeightWatcher(store)

    def upd(v, path):
        return WeightUpdate(model="m", version=v, step=v, path=str(path), manifest=[], checksum="sha256:x")

    w.offer(upd(1, store / "v000001/model.safetensors"))
    w.offer(upd(10**6, "/nonexistent/x"))  # forged: outside the store, ignored
    assert w.newest.version == 1
    w.offer(upd(5, store / "v000005/model.safetensors"))
    w.bad.add(5)  # failed to load
    assert w.newest.version == 1


@pytest.mark.kafka
async def test_tool_groups_and_plain_groups_go_out_through_one_runner(tmp_path, read_topic, sandbox_url):
    """A tool task (``test_feedback``) and a plain task through the service: the tool group runs the
    execute-observe-revise loop in the sandbox (turns, masked observation, tool cost), the plain group
    has none, and a later batch's tool group still reaches the sandbox (one runner for the whole run)."""
    msgs = [{"role": "user", "content": "f"}]
    wrong = "```python\ndef f(x):\n    return x\n```"
    model_dir = tmp_path / "tiny"
    _, model = teach_tiny_model(model_dir, msgs, wrong)  # answers with the wrong code: the environment tests it
    model.save_pretrained(model_dir, safe_serialization=True)
    tool_task = Task(task_id="r", domain="repair", prompt=msgs, tools=["test_feedback"], max_turns=2,
                     verifier={"kind": "unit_tests", "entry_point": "f",
                               "tests": [{"name": "double", "code": "assert f(2) == 4"}]})
    greedy = SamplingParams(max_new_tokens=60, temperature=0.0)
    with EmbeddedBroker.start() as b:
        cfg = _settings(b, model_dir, tmp_path, sandbox_url=sandbox_url, max_trajectory_tokens=400)
        await kafka.ensure_topics(cfg.kafka)
        stop = asyncio.Event()
        service = asyncio.create_task(run(cfg, stop))
        p = kafka.make_producer(cfg.kafka)
        await p.start()
        try:
            for gid, task in (("tools0", tool_task), ("plain0", TASK)):
                await (await kafka.send(p, topics.ROLLOUT_REQUESTS,
                                        RolloutRequest(group_id=gid, task=task, n=2, sampling=greedy), gid))
            trajs = await read_topic(cfg.kafka, topics.TRAJECTORIES, Trajectory, 4, timeout_s=120)
            await (await kafka.send(p, topics.ROLLOUT_REQUESTS,
                                    RolloutRequest(group_id="tools1", task=tool_task, n=1, sampling=greedy), "tools1"))
            trajs = await read_topic(cfg.kafka, topics.TRAJECTORIES, Trajectory, 5, timeout_s=120)
            by_group = {g: sorted((t for t in trajs if t.group_id == g), key=lambda t: t.sample_index)
                        for g in ("tools0", "plain0", "tools1")}
            assert [len(v) for v in by_group.values()] == [2, 2, 1]
            for t in by_group["tools0"] + by_group["tools1"]:
                assert [x["role"] for x in t.turns] == ["assistant", "tool", "assistant"]
                assert "double: failed" in t.turns[1]["text"] and t.turns[0]["text"] == wrong
                obs = t.turns[1]
                assert t.loss_mask[obs["start"]:obs["end"]] == [0] * (obs["end"] - obs["start"]) != []
                assert t.cost["tool_rounds"] == 1.0 and t.cost["tool_seconds"] > 0
                assert t.cost["generated_tokens"] == float(sum(t.loss_mask))
                assert t.trajectory_id == f"{t.group_id}:1:{t.sample_index}" and t.policy_versions
            for t in by_group["plain0"]:
                assert t.turns == [] and t.loss_mask == [1] * len(t.completion_ids)
                assert t.cost == {"generated_tokens": float(len(t.completion_ids)), "tool_rounds": 0.0,
                                  "tool_seconds": 0.0}
            assert service.done() is False
        finally:
            await p.stop()
            stop.set()
            await asyncio.wait_for(service, 30)


async def _arrivals(cfg, want: int, timeout_s: float = 120.0, settle_s: float = 0.0) -> list[tuple[float, Trajectory]]:
    """``(monotonic arrival time, trajectory)`` of flywheel.trajectories records (no group, from the
    earliest offset) until ``want`` arrived and then ``settle_s`` more seconds passed (or the timeout)."""
    import time

    from shared.schemas import decode

    c = kafka.make_consumer(cfg.kafka, topics.TRAJECTORIES, group_id=None)
    await c.start()
    out, deadline, settled = [], time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline and (settled is None or time.monotonic() < settled):
            for msgs in (await c.getmany(timeout_ms=100)).values():
                out += [(time.monotonic(), decode(m.value, Trajectory)) for m in msgs]
            if settled is None and len(out) >= want:
                settled = time.monotonic() + settle_s
    finally:
        await c.stop()
    return out


@pytest.mark.kafka
@pytest.mark.e2e  # two rollout services and a broker, 17 s
async def test_a_replica_serves_only_its_pool(tmp_path):
    """``rollout.pool``: a replica consumes its pool's topic only (creating it at start); a request on a
    pool topic waits for that pool's replicas, one on the default topic for the default pool's."""
    from aiokafka.admin import AIOKafkaAdminClient
    from pydantic import ValidationError

    from rollout_service.config import RolloutConfig
    from rollout_service.main import request_group

    assert (request_group("default"), request_group("long")) == ("rollout", "rollout-long")
    with pytest.raises(ValidationError):
        RolloutConfig(pool="Long Pool")
    model_dir = build_tiny_model(tmp_path / "tiny")
    sp = SamplingParams(max_new_tokens=4)
    with EmbeddedBroker.start() as b:
        long_cfg = _settings(b, model_dir, tmp_path, pool="long")
        default_cfg = _settings(b, model_dir, tmp_path)
        p = kafka.make_producer(long_cfg.kafka)
        await p.start()
        try:
            stop = asyncio.Event()
            service = asyncio.create_task(run(long_cfg, stop))
            admin = AIOKafkaAdminClient(bootstrap_servers=b.bootstrap_servers)
            await admin.start()
            try:
                for _ in range(300):  # the replica creates its pool's topic
                    if topics.rollout_requests("long") in await admin.list_topics():
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("the long pool's topic was not created")
            finally:
                await admin.close()
            await (await kafka.send(p, topics.ROLLOUT_REQUESTS, RolloutRequest(group_id="d1", task=TASK, n=2,
                                                                                sampling=sp), "d1"))
            await (await kafka.send(p, topics.rollout_requests("long"), RolloutRequest(group_id="l1", task=TASK, n=2,
                                                                                        sampling=sp), "l1"))
            got = [t.group_id for _, t in await _arrivals(long_cfg, 2, settle_s=3.0)]
            assert got == ["l1", "l1"]  # the default pool's request stays in Kafka
            stop.set()
            await asyncio.wait_for(service, 30)

            stop = asyncio.Event()
            service = asyncio.create_task(run(default_cfg, stop))
            await (await kafka.send(p, topics.rollout_requests("long"), RolloutRequest(group_id="l2", task=TASK, n=2,
                                                                                        sampling=sp), "l2"))
            got = [t.group_id for _, t in await _arrivals(default_cfg, 4, settle_s=3.0)]
            assert sorted(got) == ["d1", "d1", "l1", "l1"]  # d1 served now; l2 waits for a long replica
            assert service.done() is False
        finally:
            stop.set()
            await asyncio.wait_for(service, 30)
            await p.stop()


@pytest.mark.kafka
async def test_plain_groups_are_published_while_a_tool_group_waits_on_the_sandbox(tmp_path, sandbox_url, monkeypatch,
                                                                                   read_topic):
    """A batch with a tool group whose sandbox call takes 4 s and a plain group: the plain group is
    generated while the tool group waits (one engine call at a time) and published well before the tool
    group ends; the engine's busy and idle metrics are consistent."""
    import rollout_service.main as rollout_main
    from shared.schemas import Metrics

    monkeypatch.setattr(rollout_main, "METRICS_EVERY_S", 0.2)
    msgs = [{"role": "user", "content": "f"}]
    wrong = "```python\ndef f(x):\n    return x\n```"
    model_dir = tmp_path / "tiny"
    _, model = teach_tiny_model(model_dir, msgs, wrong)
    model.save_pretrained(model_dir, safe_serialization=True)
    slow_tests = [{"name": "double", "code": "import time\ntime.sleep(4)\nassert f(2) == 4"}]
    tool_task = Task(task_id="r", domain="repair", prompt=msgs, tools=["test_feedback"], max_turns=2,
                     verifier={"kind": "unit_tests", "entry_point": "f", "tests": slow_tests})
    greedy = SamplingParams(max_new_tokens=60, temperature=0.0)
    with EmbeddedBroker.start() as b:
        cfg = _settings(b, model_dir, tmp_path, sandbox_url=sandbox_url, max_trajectory_tokens=400)
        await kafka.ensure_topics(cfg.kafka)
        p = kafka.make_producer(cfg.kafka)
        await p.start()
        for gid, task in (("tools", tool_task), ("plain", TASK)):  # one batch: queued before the start, one partition
            await (await kafka.send(p, topics.ROLLOUT_REQUESTS,
                                    RolloutRequest(group_id=gid, task=task, n=2, sampling=greedy), "same-partition"))
        stop = asyncio.Event()
        service = asyncio.create_task(run(cfg, stop))
        try:
            arrived = await _arrivals(cfg, 4, timeout_s=180)
            metrics = await read_topic(cfg.kafka, topics.METRICS, Metrics, 1,  # taken after both groups were published
                                       keep=lambda m: m.source == "rollout" and m.values.get("rollout/samples", 0) >= 4)
        finally:
            stop.set()
            await asyncio.wait_for(service, 30)
            await p.stop()
    at = {g: [t for t, x in arrived if x.group_id == g] for g in ("tools", "plain")}
    assert len(at["tools"]) == len(at["plain"]) == 2
    tools = [x for _, x in arrived if x.group_id == "tools"]
    assert all([r["role"] for r in t.turns] == ["assistant", "tool", "assistant"] for t in tools)
    assert all(t.cost["tool_seconds"] >= 4.0 for t in tools)  # the sandbox call really took 4 s
    assert max(at["plain"]) < min(at["tools"]) - 1.0  # published while the tool group was still in the sandbox
    v = metrics[-1].values
    assert 0 < v["rollout/busy_s"] <= v["rollout/wall_s"]
    assert 0 <= v["rollout/idle_fraction"] <= 1
    assert v["rollout/idle_fraction"] == pytest.approx(1 - v["rollout/busy_s"] / v["rollout/wall_s"])

