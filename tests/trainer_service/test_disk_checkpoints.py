"""What the checkpoint store keeps of a real (tiny) model's training: only the newest complete version keeps
its optimizer state, resume from it is exact, and a finished run can keep weights only."""

from __future__ import annotations

import pytest
import torch

from flywheel.config import load_config
from shared.checkpoint import CheckpointStore
from shared.model import build_tiny_model
from shared.model_weights import snapshot_weights
from trainer_service.groups import GroupBuffer
from trainer_service.main import build_trainer

from .test_trainer import fill


def _config(tmp_path, **trainer):
    model = build_tiny_model(tmp_path / "tiny")
    return load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run")},
                       budget={"batch_groups": 1, "max_steps": 3}, trainer={"lr": 1e-2, "keep_checkpoints": 2, **trainer})


def _step(trainer, store: CheckpointStore, gid: str, done: set[str], drop_optimizer: bool = False):
    buf = GroupBuffer(1)
    fill(buf, gid, [1, 0, 0, 1])
    trainer.train_step(buf.take(1))
    done |= {gid}
    state = trainer.state_dict(done)
    if drop_optimizer:
        state["optimizer"] = None
    return store.save(snapshot_weights(trainer.model), "m", trainer.version, trainer.step, state, trained_groups=[gid])


def _files(store: CheckpointStore) -> dict[str, list[str]]:
    return {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(store.root.glob("v*"))}


def test_older_versions_lose_their_optimizer_state_and_resume_from_the_newest_is_exact(tmp_path):
    cfg = _config(tmp_path)
    trainer, store, done = build_trainer(cfg)
    sizes = []
    for k in range(3):
        _step(trainer, store, f"g{k}", done)
        sizes.append(sum(f.stat().st_size for f in store.root.rglob("*") if f.is_file()))
    weights_only = ["model.safetensors", "trained_groups.json", "update.json"]
    assert _files(store) == {"v000002": weights_only,
                             "v000003": sorted(weights_only + ["optimizer.pt", "trainer_state.pt"])}
    w = (store.version_dir(3) / "model.safetensors").stat().st_size
    opt = (store.version_dir(3) / "optimizer.pt").stat().st_size
    assert opt > 1.9 * w  # AdamW: two moments per weight (the bulk this drops from older versions)
    assert sizes[2] < 2 * w + opt + 200_000 < 2 * (w + opt)  # keep=2: 2 × weights + 1 × optimizer state

    resumed, _, rdone = build_trainer(cfg)
    assert (resumed.version, resumed.step, rdone) == (3, 3, {"g0", "g1", "g2"})
    for a, b in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    got, want = resumed.optimizer.state_dict()["state"], trainer.optimizer.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][k], want[i][k]), (i, k)


def test_a_finished_run_without_optimizer_state_restarts_at_max_steps_but_cannot_be_extended(tmp_path):
    cfg = _config(tmp_path, drop_optimizer_on_finish=True)
    trainer, store, done = build_trainer(cfg)
    for k in range(3):
        _step(trainer, store, f"g{k}", done, drop_optimizer=k == 2)  # what the Publisher writes at max_steps
    assert not list(store.root.rglob("optimizer.pt"))
    resumed, _, rdone = build_trainer(cfg)  # e.g. a restart during the final evaluation
    assert (resumed.version, rdone) == (3, {"g0", "g1", "g2"}) and not resumed.optimizer_restored
    longer = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"max_steps": 5})})
    with pytest.raises(RuntimeError, match="no optimizer state"):
        build_trainer(longer)
