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


@pytest.mark.kafka
async def test_the_next_step_waits_for_the_previous_versions_files(setup, read_topic, monkeypatch):  # noqa: F811
    cfg = setup.model_copy(update={"budget": setup.budget.model_copy(update={"max_staleness": 4})})  # none stale
    written: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
    real_weights, real_state = CheckpointStore.save_weights, CheckpointStore.save_trainer_state

    def slow_weights(self, weights, model_name, version, step, trained_groups=None):
        before = {k: v.clone() for k, v in weights.items()}
        time.sleep(0.5)  # the next step has its data and trains meanwhile
        update = real_weights(self, weights, model_name, version, step, trained_groups)
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
    from trainer_service.main import StepSnapshot

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
    from trainer_service.main import Publisher, StepSnapshot

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
    from trainer_service.main import StepSnapshot

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

    from trainer_service import main as trainer_main
    from trainer_service.main import StepSnapshot

    threads = trainer_main.WRITERS._max_workers
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


async def test_a_stop_waits_for_an_absent_broker_only_drain_broker_wait_s(tmp_path):
    """A graceful stop while the version's announcement waits for a broker that is gone (the supervisor died
    and took the broker with it): the drain gives up ``trainer.drain_broker_wait_s`` after the wait began,
    not after its whole 120 s bound, and not before; the weights file is written by then (real Publisher and
    CheckpointStore, no producer: the broker is away)."""
    import asyncio

    from flywheel.config import load_config
    from trainer_service.groups import GroupBuffer
    from trainer_service.main import Publisher, StepSnapshot, TrainLoop

    grace = 1.5
    cfg = load_config(model={"name": "tiny"}, run={"dir": str(tmp_path / "run")},
                      trainer={"disk_reserve_bytes": 0, "drain_broker_wait_s": grace})
    store = CheckpointStore(tmp_path / "ckpt")
    publisher = Publisher(cfg, store, GroupBuffer(1), producer=None)
    loop = TrainLoop(cfg, None, GroupBuffer(1), None, None, publisher)
    gate = threading.Event()
    snap = StepSnapshot([], {"w": torch.ones(4)}, {"step": 1, "optimizer": None}, {}, 1, 1, gate)
    loop.publishing = asyncio.create_task(publisher.publish(snap, None))
    while publisher.broker_wait_since is None:  # the file is written; the announcement waits
        assert not loop.publishing.done()
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError, match="broker"):
        await loop.drain()
    waited = time.monotonic() - t0
    assert grace - 0.1 <= waited < grace + 5, waited
    assert loop.publishing.cancelled() and publisher.broker_wait_since is None
    assert store.version_dir(1).is_dir() and gate.is_set()


async def test_a_stop_waits_for_a_slow_write_its_whole_bound(tmp_path, monkeypatch):
    """No broker wait, a write that takes long: the drain's own bound applies (here shortened to 1 s), not
    ``drain_broker_wait_s``."""
    import asyncio

    from flywheel.config import load_config
    from trainer_service.groups import GroupBuffer
    from trainer_service.main import Publisher, StepSnapshot, TrainLoop

    cfg = load_config(model={"name": "tiny"}, run={"dir": str(tmp_path / "run")},
                      trainer={"disk_reserve_bytes": 0, "drain_broker_wait_s": 0.0})
    store = CheckpointStore(tmp_path / "ckpt")
    entered, go = _hold_weight_writes(monkeypatch)
    publisher = Publisher(cfg, store, GroupBuffer(1), producer=None)
    loop = TrainLoop(cfg, None, GroupBuffer(1), None, None, publisher)
    snap = StepSnapshot([], {"w": torch.ones(4)}, {"step": 1, "optimizer": None}, {}, 1, 1, threading.Event())
    loop.publishing = asyncio.create_task(publisher.publish(snap, None))
    assert await asyncio.to_thread(entered.wait, 30)
    t0 = time.monotonic()
    try:
        with pytest.raises(asyncio.TimeoutError, match="1 s"):
            await loop.drain(timeout_s=1.0)
        assert time.monotonic() - t0 >= 0.95
    finally:
        go.set()
