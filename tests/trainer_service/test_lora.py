"""LoRA training (``trainer.lora``): only the adapters train and are published, an engine applying a version's
adapter serves the trainer's policy (equal log-probs), the checkpoint store keeps adapters and a resume restores
them, the saved names are peft's own, and an engine that skips the adapter is caught by the canary check."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout_service.torch_engine import TorchEngine
from shared import lora
from shared.canary import TOLERANCE, canary_diff
from shared.checkpoint import ADAPTER_FILE, CheckpointStore
from shared.model import build_tiny_model, load_model, load_tokenizer
from shared.model_weights import load_weights
from shared.schemas import WeightUpdate
from trainer_service.canary import CanaryCheck
from trainer_service.config import LoraConfig, TrainerConfig, TrainerSettings
from trainer_service.groups import GroupBuffer
from trainer_service.trainer import PolicyTrainer

from .test_trainer import fill

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32 references

LORA = LoraConfig(r=4, alpha=8.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny")


def _trained(tiny, steps: int = 2, lr: float = 5e-2, kl: float = 0.0) -> PolicyTrainer:
    torch.manual_seed(0)
    tr = PolicyTrainer(load_model(tiny), TrainerConfig(lr=lr, lora=LORA, kl_coef=kl), pad_id=0)
    buf = GroupBuffer(1)
    for s in range(steps):
        fill(buf, f"g{s}", [1, 0, 0, 1], comp=(5, 6, 7, 8))
        tr.train_step(buf.take(1))
    return tr


def _logits(model, ids=((1, 2, 3, 5, 6, 7),)):
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_only_the_adapters_train_and_are_published(tiny):
    base = {k: v.clone() for k, v in load_model(tiny).state_dict().items()}
    tr = _trained(tiny, kl=0.1)
    info = tr.adapter
    assert info is not None and len(info.target_modules) == 14  # 2 layers × (q, k, v, o, gate, up, down)
    assert all("lm_head" not in m and "embed" not in m for m in info.target_modules)
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    # AdamW holds moments for the adapters only
    assert sum(p.numel() for g in tr.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in tr.model.parameters() if p.requires_grad)
    # the frozen base is untouched; the adapters moved (B starts at 0)
    for name, p in tr.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name
    published = tr.published_weights()
    assert set(published) == {n for m in info.target_modules for n in lora.tensor_names(m)}
    assert any(t.abs().sum() > 0 for n, t in published.items() if n.endswith("lora_B.weight"))
    # the reference (KL) is the base policy, not the adapted one
    assert torch.allclose(_logits(tr.ref_model), _logits(load_model(tiny)))
    assert not torch.allclose(_logits(tr.model), _logits(load_model(tiny)), atol=1e-4)


def test_the_saved_names_are_peft_own(tiny):
    """A version's file is a peft adapter: the names peft itself saves for the same LoRA config."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, get_peft_model_state_dict

    tr = _trained(tiny, steps=0)
    peft_model = get_peft_model(load_model(tiny), PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert set(get_peft_model_state_dict(peft_model)) == set(tr.published_weights())


def test_an_engine_applying_the_adapter_serves_the_trainers_policy(tiny, tmp_path):
    tr = _trained(tiny)
    store = CheckpointStore(tmp_path / "ckpt")
    update = store.save(tr.published_weights(), "tiny", tr.version, tr.step, tr.state_dict(set()),
                        adapter=tr.adapter)
    assert update.adapter == tr.adapter and update.path.endswith(ADAPTER_FILE)
    full = sum(t.numel() for t in load_model(tiny).state_dict().values())
    assert sum(t.numel() for t in load_file(update.path).values()) < 0.1 * full
    engine = TorchEngine(load_model(tiny), load_tokenizer(tiny), seed=1)
    engine.update_weights(WeightUpdate.model_validate_json(update.encode()))  # as read from flywheel.weights
    assert engine.policy_version == tr.version
    torch.testing.assert_close(_logits(engine.model), _logits(tr.model), atol=1e-5, rtol=1e-5)
    # a later version is applied to the kept base, not on top of the previous one
    tr2 = _trained(tiny, steps=3)
    u2 = store.save(tr2.published_weights(), "tiny", tr2.version, tr2.step, None, adapter=tr2.adapter)
    engine.update_weights(u2)
    torch.testing.assert_close(_logits(engine.model), _logits(tr2.model), atol=1e-5, rtol=1e-5)
    # and the merge an export uses gives the same model
    merged = load_model(tiny)
    merged.load_state_dict(lora.merge_weights(load_model(tiny).state_dict(), load_file(u2.path), u2.adapter))
    torch.testing.assert_close(_logits(merged), _logits(tr2.model), atol=1e-5, rtol=1e-5)


def test_a_resume_restores_the_adapters_and_refuses_the_other_setting(tiny, tmp_path):
    tr = _trained(tiny)
    store = CheckpointStore(tmp_path / "ckpt")
    update = store.save(tr.published_weights(), "tiny", tr.version, tr.step, tr.state_dict(set()),
                        adapter=tr.adapter)
    again = PolicyTrainer(load_model(tiny), TrainerConfig(lora=LORA), pad_id=0)
    again.load_published(store.latest())
    again.load_state_dict(store.load_trainer_state(update.version))
    torch.testing.assert_close(_logits(again.model), _logits(tr.model), atol=0, rtol=0)
    with pytest.raises(ValueError, match="trainer.lora is not set"):
        PolicyTrainer(load_model(tiny), TrainerConfig(), pad_id=0).load_published(update)
    with pytest.raises(ValueError, match="differ"):
        PolicyTrainer(load_model(tiny), TrainerConfig(lora=LoraConfig(r=8)), pad_id=0).load_published(update)
    with pytest.raises(ValueError, match="not full weights"):
        load_weights(load_model(tiny), update)


def test_an_adapter_that_does_not_fit_is_refused_and_changes_nothing(tiny, tmp_path):
    tr = _trained(tiny)
    state = tr.published_weights(live=False)
    engine = TorchEngine(load_model(tiny), load_tokenizer(tiny))
    before = _logits(engine.model)
    bad = dict(state)
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError, match="missing adapter tensors"):
        engine._adapters.apply(engine.model, bad, tr.adapter)
    wrong = tr.adapter.model_copy(update={"target_modules": ["model.layers.0.nope"]})
    with pytest.raises(ValueError):
        engine._adapters.apply(engine.model, {n: state[n] for n in lora.tensor_names(tr.adapter.target_modules[0])},
                               wrong)
    assert torch.equal(_logits(engine.model), before)


def test_lora_needs_the_checkpoint_transport():
    with pytest.raises(ValueError, match="weights.transport: checkpoint"):
        TrainerSettings(trainer={"lora": {"r": 8}}, weights={"transport": "distributed"})


def test_an_engine_that_skips_the_adapter_fails_the_canary_and_none_of_its_samples_train(tiny, tmp_path):
    """A peer shipped LoRA syncs that served the frozen base for months: here the engine says it holds the
    version, the canary says it serves the base, and its group is dropped while the faithful engine's trains."""
    from .test_canary import _group

    tr = _trained(tiny, lr=0.2)
    tok = load_tokenizer(tiny)
    check = CanaryCheck(tr.model, tok)
    check.record(tr.version)
    update = CheckpointStore(tmp_path / "ckpt").save(tr.published_weights(), "tiny", tr.version, tr.step, None,
                                                     adapter=tr.adapter)
    good = TorchEngine(load_model(tiny), tok, seed=1)
    good.update_weights(update)
    skipped = TorchEngine(load_model(tiny), tok, seed=2)
    skipped.policy_version = tr.version  # announced as loaded; the adapter never applied
    skipped._loaded(tr.version)
    good.engine_id, skipped.engine_id = "replica-a:1", "replica-b:2"
    assert canary_diff(skipped._canary[tr.version], check.scores[tr.version]) > TOLERANCE["float32"]
    buf = GroupBuffer(max_staleness=1)
    _group(buf, skipped, "skipped", 0)
    _group(buf, good, "applied", 10)
    assert buf.drop_unless(lambda g: check.check(g).ok, "dropped_canary") == 1
    assert [g.group_id for g in buf.ready] == ["applied"]
    assert [(d.group_id, d.reason) for d in buf.take_drops()] == [("skipped", "canary")]
    assert set(check.failing) == {skipped.engine_id}
