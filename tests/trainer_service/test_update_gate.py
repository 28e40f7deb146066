"""The trainer writes a version's checkpoint from the live tensors (no copy): its next optimizer step must wait
until they are on disk, so every checkpoint holds exactly its own version (real service, broker and files)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shared import topics
from shared.checkpoint import CheckpointStore
from shared.schemas import Metrics, WeightUpdate
from trainer_service.trainer import PolicyTrainer

from .test_trainer_service import _produce, _scored, _with_trainer, setup  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32/64 references


@pytest.mark.kafka
@pytest.mark.e2e  # three real steps with slowed checkpoint writes (about a minute): the e2e tier
async def test_the_next_step_waits_for_the_previous_versions_files(setup, read_topic, monkeypatch):  # noqa: F811
    cfg = setup.model_copy(update={"budget": setup.budget.model_copy(update={"max_staleness": 4})})  # none stale
    written: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
    real_weights, real_state = CheckpointStore.save_weights, CheckpointStore.save_trainer_state

    def slow_weights(self, weights, model_name, version, step, trained_groups=None, adapter=None):
        before = {k: v.clone() for k, v in weights.items()}
        time.sleep(0.5)  # the next step has its data and trains meanwhile
        update = real_weights(self, weights, model_name, version, step, trained_groups, adapter)
        assert all(torch.equal(before[k], v) for k, v in weights.items()), f"v{version}'s weights changed mid-write"
        return update

    def slow_state(self, update, trainer_state):
        time.sleep(1.0)
        real_state(self, update, trainer_state)
        moments = torch.load(self.version_dir(update.version) / "optimizer.pt", weights_only=False)
        written[update.version] = (float(moments["state"][0]["step"]), trainer_state["step"])

    monkeypatch.setattr(CheckpointStore, "save_weights", slow_weights)
    monkeypatch.setattr(CheckpointStore, "save_trainer_state", slow_state)

    async def body():
        await _produce(cfg.kafka, [_scored(g, i, float(i)) for g in ("g1", "g2", "g3") for i in (0, 1)])
        ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 3)
        assert [w.version for w in ws] == [1, 2, 3]

    await _with_trainer(cfg, body)
    metrics = await read_topic(cfg.kafka, topics.METRICS, Metrics, 3, keep=lambda r: r.domain is None)
    # each version's optimizer.pt has that many AdamW steps in it, not one more (the step counter is a tensor
    # that the next optimizer step increments in place)
    assert {v: s for v, (s, _) in written.items()} == {1: 1.0, 2: 2.0, 3: 3.0}
    assert all(step == v for v, (_, step) in written.items())
    gate = [m.values["time/update_gate_s"] for m in metrics]
    assert max(gate[1:]) > 0.5  # the steps after the first waited for their predecessor's files
    assert all(m.values["time/snapshot_s"] < 0.5 for m in metrics)  # nothing copied


def test_the_gate_is_open_for_a_trainer_used_without_the_service():
    from trainer_service.config import TrainerConfig

    # tests and benchmarks that call train_step directly must never block on it
    trainer = PolicyTrainer(torch.nn.Linear(2, 2), TrainerConfig(), pad_id=0)
    assert trainer.update_gate.is_set() and trainer.gate_wait_s == 0.0


def test_detach_copies_the_live_tensors_and_opens_the_gate_once():
    from trainer_service.publisher import StepSnapshot

    gate = threading.Event()
    w = {"w": torch.ones(4)}
    moments = {"state": {0: {"exp_avg": torch.zeros(4)}}}
    snap = StepSnapshot([], w, {"step": 1, "optimizer": moments}, {}, 1, 1, gate)
    snap.detach()  # what the publisher does before waiting out a broker outage or a full disk
    assert gate.is_set() and snap.gate is None
    w["w"].add_(1)  # the trainer's next step changes the live tensors ...
    moments["state"][0]["exp_avg"].add_(1)
    assert torch.equal(snap.weights["w"], torch.ones(4))  # ... not what will be written
    assert torch.equal(snap.state["optimizer"]["state"][0]["exp_avg"], torch.zeros(4))
    gate.clear()  # the next version's
    snap.detach()
    snap.release()
    assert not gate.is_set()  # neither opens the gate a second time


def _hold_weight_writes(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """``CheckpointStore.save_weights`` waits (≤ 30 s) in its write thread until the second event is set; the
    first is set when a write has entered."""
    entered, go = threading.Event(), threading.Event()
    real = CheckpointStore.save_weights

    def held(self, weights, *args, **kwargs):
        entered.set()
        go.wait(30)
        return real(self, weights, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "save_weights", held)
    return entered, go


async def test_a_cancelled_publication_opens_the_gate_only_when_its_write_returns(tmp_path, monkeypatch):
    """The trainer's drain at shutdown waits ≤ 120 s for a publication, then cancels it; the write thread goes
    on reading the live tensors. The gate must stay closed until that thread returns, or the next optimizer
    step could change tensors that are being written (real Publisher and CheckpointStore, the write held)."""
    import asyncio

    from flywheel.config import load_config
    from trainer_service.groups import GroupBuffer
    from trainer_service.publisher import Publisher, StepSnapshot

    cfg = load_config(model={"name": "tiny"}, run={"dir": str(tmp_path / "run")},
                      trainer={"disk_reserve_bytes": 0})  # a nearly full disk must not take the waiting path
    store = CheckpointStore(tmp_path / "ckpt")
    entered, go = _hold_weight_writes(monkeypatch)
    gate, w = threading.Event(), {"w": torch.ones(4)}
    snap = StepSnapshot([], w, {"step": 1, "optimizer": None}, {}, 1, 1, gate)
    publishing = asyncio.create_task(Publisher(cfg, store, GroupBuffer(1), producer=None).publish(snap, None))
    assert await asyncio.to_thread(entered.wait, 30)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(publishing, timeout=0.1)  # drain's timeout, shortened
    assert publishing.cancelled()
    assert not gate.is_set(), "the gate opened while the write still reads the live tensors"
    go.set()
    assert await asyncio.to_thread(gate.wait, 30), "the gate never opened after the write returned"
    assert store.version_dir(1).is_dir()  # the write finished after all


async def test_in_thread_returns_and_raises_what_the_function_does():
    from trainer_service.publisher import StepSnapshot

    gate = threading.Event()
    snap = StepSnapshot([], {}, {}, {}, 1, 1, gate)
    assert await snap.in_thread(lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        await snap.in_thread(lambda: 1 / 0)
    snap.release()  # no thread running: opens at once
    assert gate.is_set()


async def test_a_write_cancelled_before_it_started_does_not_keep_the_gate_shut():
    """Every publisher thread busy: one more write waits in the pool's queue. Cancelled there, it never runs, and
    the gate must still open once the running ones return (else the next optimizer step would wait forever)."""
    import asyncio

    from trainer_service import publisher as trainer_publisher
    from trainer_service.publisher import StepSnapshot

    threads = trainer_publisher.WRITERS._max_workers
    busy, go = threading.Barrier(threads + 1), threading.Event()

    def hold():
        busy.wait(30)
        go.wait(30)

    gate = threading.Event()
    snap = StepSnapshot([], {}, {}, {}, 1, 1, gate)
    running = [asyncio.ensure_future(snap.in_thread(hold)) for _ in range(threads)]
    await asyncio.to_thread(busy.wait, 30)  # every publisher thread is in hold()
    ran = threading.Event()
    queued = asyncio.ensure_future(snap.in_thread(ran.set))
    await asyncio.sleep(0.05)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    snap.release()
    assert not gate.is_set()  # the running writes still read
    go.set()
    await asyncio.gather(*running)
    assert await asyncio.to_thread(gate.wait, 10), "a write that never ran kept the gate shut"
    assert not ran.is_set()


@pytest.mark.kafka
async def test_a_stop_with_the_broker_gone_writes_the_version_whole_and_gives_up_its_announcement(tmp_path):
    """The supervisor died and took the broker with it while a version is being published: the stop waits
    ``trainer.drain_broker_wait_s`` from the broker watch's first sight of the loss (not the drain's 120 s, and
    not less), then abandons the announcement; the version's files are all written (trainer state included),
    so the next start resumes at it exactly. Real broker (killed), producer, watch, Publisher and store."""
    import asyncio

    from flywheel.broker import EmbeddedBroker
    from flywheel.config import load_config
    from shared import kafka
    from trainer_service.groups import GroupBuffer
    from trainer_service.loop import TrainLoop
    from trainer_service.publisher import Publisher, StepSnapshot

    grace = 1.5
    broker = EmbeddedBroker.start(log_path=tmp_path / "broker.log", with_parent=True)
    producer = watch = None
    try:
        cfg = load_config(model={"name": "tiny"}, run={"dir": str(tmp_path / "run")},
                          kafka={"bootstrap_servers": broker.bootstrap_servers},
                          trainer={"disk_reserve_bytes": 0, "drain_broker_wait_s": grace})
        producer = kafka.make_producer(cfg.kafka)
        await producer.start()
        watch = kafka.BrokerWatch(cfg.kafka, "test")
        assert await asyncio.wait_for(watch.wait_up(), 30)
        store = CheckpointStore(tmp_path / "ckpt")
        buffer = GroupBuffer(1)
        publisher = Publisher(cfg, store, buffer, producer=producer)
        loop = TrainLoop(cfg, None, buffer, None, producer, publisher)  # no consumer: nothing to read
        gate = threading.Event()
        logged = {k: 0.0 for k in ("train/reward_mean", "loss/pg", "time/train_step_s", "time/wait_for_data_s")}
        snap = StepSnapshot([], {"w": torch.ones(4)}, {"step": 1, "optimizer": None}, logged, 1, 1, gate)
        broker.stop()
        deadline = time.monotonic() + 30
        while watch.down_for() is None:  # the watch has seen the broker go
            assert time.monotonic() < deadline, "the broker watch did not see the broker stop"
            await asyncio.sleep(0.01)
        loop.publishing = asyncio.create_task(publisher.publish(snap, None))
        await asyncio.wait_for(loop.drain(watch.down_for), 60)  # abandoned, not failed: no error
        assert watch.down_for() >= grace
        assert publisher.abandoned
        assert store.latest() is not None and store.latest().version == 1  # weights and trainer state
        assert gate.is_set()
    finally:
        broker.stop()
        if watch is not None:
            await watch.close()
        if producer is not None:
            await kafka.stop_clients(producer)


async def test_a_stop_with_the_broker_up_never_abandons_and_cancels_at_its_bound(tmp_path):
    """The broker answers (the watch says so) but the announcement does not get through: the stop does not
    give up on the broker's account, only at the drain's own bound (here 1 s, not 120), by cancelling."""
    import asyncio

    from flywheel.config import load_config
    from trainer_service.groups import GroupBuffer
    from trainer_service.loop import TrainLoop
    from trainer_service.publisher import Publisher, StepSnapshot

    cfg = load_config(model={"name": "tiny"}, run={"dir": str(tmp_path / "run")},
                      trainer={"disk_reserve_bytes": 0, "drain_broker_wait_s": 0.0})
    store = CheckpointStore(tmp_path / "ckpt")
    publisher = Publisher(cfg, store, GroupBuffer(1), producer=None)  # every send fails: BrokerLost
    loop = TrainLoop(cfg, None, GroupBuffer(1), None, None, publisher)
    snap = StepSnapshot([], {"w": torch.ones(4)}, {"step": 1, "optimizer": None}, {}, 1, 1, threading.Event())
    loop.publishing = asyncio.create_task(publisher.publish(snap, None))
    with pytest.raises(asyncio.TimeoutError, match="1 s"):
        await loop.drain(lambda: None, timeout_s=1.0)
    assert loop.publishing.cancelled() and not publisher.abandoned
    assert store.version_dir(1).is_dir() and store.latest() is None  # weights written, trainer state not


@pytest.mark.kafka
async def test_a_stop_between_broker_sessions_writes_the_held_version_whole(tmp_path, monkeypatch):
    """The whole service (``trainer_service.main.run``, tiny model, real broker): step 1 is being published
    (its weights write held) when the broker goes; the session ends and ``run`` waits for the broker. A stop
    then comes between two sessions, with no client left to announce on: ``run`` abandons the announcements at
    once (no ``drain_broker_wait_s`` to wait: 60 s here) and still writes version 1 whole, trainer state included,
    so the next start resumes at it. Before, the held publication was cancelled at teardown; and a commit under
    way when the broker went waited for a group coordinator (aiokafka) until the broker came back, so the session
    never ended and the stop found no drain to do (3 runs of 4 failed that way before the commit was guarded)."""
    import asyncio

    from flywheel.broker import EmbeddedBroker
    from flywheel.config import load_config
    from shared import kafka
    from shared.model import build_tiny_model
    from trainer_service.main import run

    model = build_tiny_model(tmp_path / "tiny")
    entered, go = _hold_weight_writes(monkeypatch)
    broker = EmbeddedBroker.start(log_path=tmp_path / "broker.log", with_parent=True)
    stop, task = asyncio.Event(), None
    try:
        cfg = load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run")},
                          kafka={"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
                          budget={"batch_groups": 1, "max_steps": 10, "max_staleness": 5},
                          telemetry={"traces": "off"}, trainer={"disk_reserve_bytes": 0, "drain_broker_wait_s": 60})
        await kafka.ensure_topics(cfg.kafka)
        task = asyncio.create_task(run(cfg, stop))
        await _produce(cfg.kafka, [_scored("g1", 0, 1.0), _scored("g1", 1, 0.0)])
        assert await asyncio.to_thread(entered.wait, 120), "step 1 was not trained"
        broker.stop()
        log_path = tmp_path / "run" / "logs" / "trainer.log"
        deadline = time.monotonic() + 60
        while "broker unreachable, retrying" not in log_path.read_text():  # the session is over
            assert time.monotonic() < deadline, "the trainer did not notice the broker go"
            assert not task.done(), task
            await asyncio.sleep(0.1)
        stop.set()
        go.set()
        await asyncio.wait_for(task, 30)  # not the 60 s grace, not the drain's 120 s
    finally:
        go.set()
        stop.set()
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        broker.stop()
    latest = CheckpointStore(tmp_path / "run" / "checkpoints").latest()
    assert latest is not None and latest.version == 1, latest  # weights, trainer state and latest.json
    text = log_path.read_text()
    assert "policy version 1 is written but not announced" in text
    assert "trainer stopped at policy version 1" in text
