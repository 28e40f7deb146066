"""The checkpoint store's two-phase save and the trainer's resume at the newest published version."""

import torch

from shared.checkpoint import CheckpointStore
from flywheel.config import load_config
from shared.model import build_tiny_model
from shared.model_weights import snapshot_weights
from trainer_service.groups import GroupBuffer
from trainer_service.main import build_trainer

from .test_trainer import fill


def _config(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    return load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run")},
                       budget={"batch_groups": 1}, trainer={"lr": 1e-2, "keep_checkpoints": 2})


def _step(trainer, store, gid, done, complete=True):
    buf = GroupBuffer(1)
    fill(buf, gid, [1, 0, 0, 1])
    groups = buf.take(1)
    trainer.train_step(groups)
    done |= {gid}
    args = (snapshot_weights(trainer.model), "m", trainer.version, trainer.step)
    if complete:
        return store.save(*args, trainer.state_dict(done), trained_groups=[gid])
    return store.save_weights(*args, trained_groups=[gid])  # then the process dies


def test_weights_are_published_before_the_trainer_state_and_latest_waits_for_both(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=2)
    w = {"a": torch.ones(3)}
    upd = store.save_weights(w, "m", 1, 1, ["g"])
    assert store.newest_published().version == 1 and store.latest() is None
    assert store.trained_groups(1) == {"g"} and not list((tmp_path / "ck").glob("*.tmp"))
    store.save_trainer_state(upd, {"step": 1})
    assert store.latest().version == 1 and store.load_trainer_state(1) == {"step": 1}
    for v in (2, 3):
        store.save(w, "m", v, v, {"step": v})
    assert sorted(p.name for p in (tmp_path / "ck").glob("v*")) == ["v000002", "v000003"]


def test_resume_is_exact_when_the_newest_version_is_complete(tmp_path):
    cfg = _config(tmp_path)
    trainer, store, done = build_trainer(cfg)
    _step(trainer, store, "g1", done)
    _step(trainer, store, "g2", done)
    resumed, _, rdone = build_trainer(cfg)
    assert (resumed.version, resumed.step, rdone) == (2, 2, {"g1", "g2"})
    for a, b in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 2


def test_crash_between_announce_and_trainer_state_resumes_at_the_published_version(tmp_path):
    """Weights of v2 written (and announced), its trainer state never: resume at v2, not v1, no group twice."""
    cfg = _config(tmp_path)
    trainer, store, done = build_trainer(cfg)
    _step(trainer, store, "g1", done)
    upd = _step(trainer, store, "g2", done, complete=False)
    assert store.latest().version == 1 and store.newest_published().version == upd.version == 2
    resumed, _, rdone = build_trainer(cfg)
    assert (resumed.version, resumed.step) == (2, 2)
    assert rdone == {"g1", "g2"}  # g2 came from v2's trained_groups.json, not from a trainer state
    for a, b in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 1  # the moments are one step older
