"""The checkpoint store on a full disk and what it keeps: a write that fails leaves nothing half-written,
and only the newest complete version keeps its optimizer state (real files; a real small tmpfs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.system import small_tmpfs
import torch

from shared.checkpoint import CheckpointStore
from shared.disk import DiskFullError, DiskPolicy, checkpoint_bytes, is_disk_full


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (needs root; unmounted in teardown)."""
    with small_tmpfs(tmp_path, 2) as d:
        yield d


def _names(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_full_disk_fails_the_write_cleanly_and_latest_stays_the_complete_version(small_fs):
    store = CheckpointStore(small_fs / "ck", keep=2)
    small = {"w": torch.ones(1000)}  # 4 kB
    big = {"w": torch.ones(1 << 20)}  # 4 MiB: more than the file system holds
    store.save(small, "m", 1, 1, {"step": 1, "optimizer": {"m": torch.zeros(1000)}}, ["g1"])
    before = _names(store.root)

    with pytest.raises(DiskFullError) as e:  # phase 1 (weights) runs out of space
        store.save_weights(big, "m", 2, 2, ["g2"])
    assert is_disk_full(e.value) and "v000002.tmp" in str(e.value)
    assert _names(store.root) == before  # the temporary directory is gone
    assert store.newest_published().version == 1 and store.latest().version == 1

    upd = store.save_weights(small, "m", 2, 2, ["g2"])  # phase 1 fits, phase 2 (optimizer state) does not
    with pytest.raises(DiskFullError):
        store.save_trainer_state(upd, {"step": 2, "optimizer": {"m": torch.zeros(1 << 20)}})
    v2 = sorted(p.name for p in store.version_dir(2).iterdir())
    assert v2 == ["model.safetensors", "trained_groups.json", "update.json"]  # no partial optimizer.pt(.tmp)
    assert store.latest().version == 1  # never the half-written version
    state = store.load_trainer_state(1)
    assert state["step"] == 1 and torch.equal(state["optimizer"]["m"], torch.zeros(1000))
    assert not list(store.root.rglob("*.tmp"))


def test_remove_partial_deletes_what_an_interrupted_write_left(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    store.save({"w": torch.ones(3)}, "m", 1, 1, {"step": 1})
    (store.root / "v000002.tmp").mkdir()
    (store.root / "v000002.tmp" / "model.safetensors").write_bytes(b"half")
    (store.version_dir(1) / "optimizer.pt.tmp").write_bytes(b"half")
    assert sorted(p.name for p in store.remove_partial()) == ["optimizer.pt.tmp", "v000002.tmp"]
    assert not list(store.root.rglob("*.tmp")) and store.latest().version == 1


def test_only_the_newest_complete_version_keeps_trainer_and_optimizer_state(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=3)
    for v in (1, 2, 3, 4):
        store.save({"w": torch.full((100,), float(v))}, "m", v, v, {"step": v, "optimizer": {"m": torch.ones(200)}})
    files = {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(store.root.glob("v*"))}
    weights_only = ["model.safetensors", "trained_groups.json", "update.json"]
    assert files == {"v000002": weights_only, "v000003": weights_only,
                     "v000004": sorted(weights_only + ["optimizer.pt", "trainer_state.pt"])}
    state = store.load_trainer_state(4)
    assert state["step"] == 4 and torch.equal(state["optimizer"]["m"], torch.ones(200))
    # a published version without its state (crash between the phases) keeps the previous one's state
    store.save_weights({"w": torch.zeros(100)}, "m", 5, 5)
    store.prune()
    assert (store.version_dir(4) / "optimizer.pt").exists() and store.latest().version == 4


def test_the_previous_layout_still_loads(tmp_path):
    """The older layout: the optimizer inside ``trainer_state.pt``."""
    store = CheckpointStore(tmp_path / "ck")
    store.save_weights({"w": torch.ones(3)}, "m", 1, 1)
    torch.save({"step": 1, "optimizer": {"m": torch.ones(2)}}, store.version_dir(1) / "trainer_state.pt")
    assert torch.equal(store.load_trainer_state(1)["optimizer"]["m"], torch.ones(2))


def test_disk_policy_levels_and_checkpoint_size():
    p = DiskPolicy(reserve_bytes=100, warn_checkpoints=3)
    assert p.level(free=10_000, need=1000) == "ok"
    assert p.level(free=3_000, need=1000) == "warning"  # < 100 + 3 × 1000
    assert p.level(free=1_099, need=1000) == "critical"  # 99 left after the write < 100
    assert (p.threshold("critical", 1000), p.threshold("warning", 1000)) == (1100, 3100)
    w, opt = {"a": torch.zeros(10, dtype=torch.float32)}, {"m": torch.zeros(5, dtype=torch.float64)}
    assert checkpoint_bytes(w, {"optimizer": opt, "done_groups": ["g"] * 2}) == 40 + 40 + 128 + (1 << 20)
