"""The trainer service on a full disk (a real 8 MiB tmpfs, a real broker, the tiny model): it alerts and waits
instead of dying with ENOSPC, never publishes a half-written version, and goes on once space is freed."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.system import small_tmpfs

from flywheel.broker import EmbeddedBroker
from flywheel.config import load_config
from shared import topics
from shared.checkpoint import CheckpointStore
from shared.model import build_tiny_model
from shared.schemas import Alert, WeightUpdate
from trainer_service.main import run

from .test_trainer_service import _produce, _scored

MiB = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    """A 8 MiB tmpfs mounted for the test (needs root; unmounted in teardown)."""
    with small_tmpfs(tmp_path, 8) as d:
        yield d


async def _until_latest(store: CheckpointStore, version: int, timeout_s: float = 30.0) -> None:
    """Wait until ``latest.json`` names ``version``: the trainer writes it after the version's announcement."""
    deadline = time.monotonic() + timeout_s
    while (latest := store.latest()) is None or latest.version != version:
        assert time.monotonic() < deadline, latest
        await asyncio.sleep(0.1)


@pytest.mark.kafka
async def test_a_full_disk_alerts_and_holds_the_step_instead_of_crashing(tmp_path, small_fs, read_topic):
    model = build_tiny_model(tmp_path / "tiny")
    with EmbeddedBroker.start() as b:
        cfg = load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run"),
                                                            "checkpoint_dir": str(small_fs / "ck")},
                          kafka={"bootstrap_servers": b.bootstrap_servers, "partitions": 2},
                          budget={"batch_groups": 1, "max_steps": 10},
                          trainer={"lr": 1e-3, "disk_reserve_bytes": MiB, "disk_warn_checkpoints": 1.0,
                                   "disk_retry_s": 0.3})
        store = CheckpointStore(cfg.run.path(cfg.run.checkpoint_dir))
        disk = lambda a: a.signal == "disk_free" and a.source == "trainer"  # noqa: E731
        stop = asyncio.Event()
        task = asyncio.create_task(run(cfg, stop))
        try:
            await _produce(cfg.kafka, [_scored("g1", 0, 1.0), _scored("g1", 1, 0.0)])
            assert [w.version for w in await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 1)] == [1]
            await _until_latest(store, 1)  # v1 whole before the disk fills (else its trainer state waits for space)
            # leave less than reserve + one checkpoint free
            ballast = small_fs / "ballast"
            ballast.write_bytes(b"\0" * (store.free_bytes() - MiB - store.version_bytes(1) // 2))
            await _produce(cfg.kafka, [_scored("g2", 0, 1.0, 1), _scored("g2", 1, 0.0, 1)])
            alerts = await read_topic(cfg.kafka, topics.ALERTS, Alert, 1, keep=disk)
            assert [(a.status, a.severity, a.key) for a in alerts] == [("firing", "critical", "run/disk_free")]
            assert alerts[0].details["free_bytes"] < alerts[0].details["need_bytes"] + MiB
            await asyncio.sleep(1.5)
            assert not task.done()  # the old trainer died here: SafetensorError "No space left on device"
            assert store.latest().version == 1 and store.newest_published().version == 1
            assert not list(store.root.rglob("*.tmp"))
            ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 2, expect=1)
            assert [w.version for w in ws] == [1]  # nothing announced while the disk is full

            ballast.unlink()  # space freed (flywheel clean): the held version is written and announced
            ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, 2, timeout_s=30)
            assert [w.version for w in ws] == [1, 2]
            alerts = await read_topic(cfg.kafka, topics.ALERTS, Alert, 2, timeout_s=30, keep=disk)
            assert [(a.status, a.severity) for a in alerts] == [("firing", "critical"), ("resolved", "critical")]
            await _until_latest(store, 2)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


@pytest.mark.kafka
async def test_a_low_disk_warns_once_and_keeps_training(tmp_path, small_fs, read_topic):
    """Free space under ``disk_warn_checkpoints`` checkpoints: steps go on, and one ``warning`` alert is sent
    while the condition holds (not one per step or per write phase)."""
    model = build_tiny_model(tmp_path / "tiny")
    with EmbeddedBroker.start() as b:
        cfg = load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run"),
                                                            "checkpoint_dir": str(small_fs / "ck")},
                          kafka={"bootstrap_servers": b.bootstrap_servers, "partitions": 2},
                          budget={"batch_groups": 1, "max_steps": 10},
                          trainer={"lr": 1e-3, "disk_reserve_bytes": MiB, "disk_warn_checkpoints": 1000.0})
        disk = lambda a: a.signal == "disk_free" and a.source == "trainer"  # noqa: E731
        stop = asyncio.Event()
        task = asyncio.create_task(run(cfg, stop))
        try:
            for k in range(3):
                await _produce(cfg.kafka, [_scored(f"g{k}", 0, 1.0, k), _scored(f"g{k}", 1, 0.0, k)])
                ws = await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, k + 1)
                assert [w.version for w in ws] == list(range(1, k + 2))
            alerts = await read_topic(cfg.kafka, topics.ALERTS, Alert, 2, keep=disk, expect=1)
            assert [(a.status, a.severity) for a in alerts] == [("firing", "warning")]
            assert alerts[0].threshold > alerts[0].value
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
