"""Training-inference mismatch: the statistics against a hand computation, their split into
all tokens and on-policy tokens in a real train step, and what bf16 numerics do to each off-policy mode."""

import math

import pytest
import torch

from shared.model import build_tiny_model, load_model
from trainer_service.config import TrainerConfig
from trainer_service.forward import collate, completion_logprobs
from trainer_service.groups import GroupBuffer
from trainer_service.losses.mismatch import mismatch_sums, onpolicy_means
from trainer_service.trainer import PolicyTrainer

from .test_trainer import scored

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32/64 references


def test_mismatch_sums_match_a_hand_computation():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    blp = torch.tensor([[-1.5, -2.0, -0.4], [-0.3, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token is padding: never counted
    out = mismatch_sums(lp, blp, mask, torch.tensor([True, False]))
    deltas = [0.5, 0.0, -0.1, 0.2, -2.0]
    k3 = [math.exp(d) - 1 - d for d in deltas]
    assert out["mismatch/abs_logp_diff_sum"] == pytest.approx(sum(abs(d) for d in deltas))
    assert out["mismatch/k3_sum"] == pytest.approx(sum(k3))
    assert out["mismatch/onpolicy_abs_logp_diff_sum"] == pytest.approx(0.6)
    assert out["mismatch/onpolicy_k3_sum"] == pytest.approx(sum(k3[:3]))
    assert out["mismatch/onpolicy_tokens"] == 3.0
    assert all(x >= 0 for x in k3)
    means = onpolicy_means(out)
    assert means["mismatch/onpolicy_abs_logp_diff"] == pytest.approx(0.2)
    assert onpolicy_means(mismatch_sums(lp, blp, mask, torch.tensor([False, False]))) == {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _groups(model, version_of, autocast=False, noise=0.0):
    """Two groups of 4 whose behaviour log-probs are the model's own fp32 ones (+ ``noise`` nats, alternating
    sign), sampled by the versions ``version_of(group, i)``."""
    buf = GroupBuffer(10)
    for g, comps in (("g1", (10, 11, 12, 13)), ("g2", (20, 21, 22))):
        rows = [scored(g, i, comp=comps, reward=float(i % 2), version=version_of(g, i)) for i in range(4)]
        with torch.no_grad():
            lp = completion_logprobs(model, collate(rows, pad_id=0), autocast)
        for i, r in enumerate(rows):
            n = len(r.trajectory.completion_ids)
            r.trajectory.completion_logprobs = [float(x) + noise * (-1) ** t for t, x in enumerate(lp[i, :n])]
            buf.add(r, ("s", 0), hash((g, i)) % 10_000)
    return buf.take(2)


def test_on_policy_mismatch_is_zero_in_fp32_and_the_stale_samples_count_only_in_the_all_token_figure(tiny):
    model = load_model(tiny)
    tr = PolicyTrainer(model, TrainerConfig(lr=1e-2, max_grad_norm=1e9), pad_id=0)
    tr.version = 3  # g1 was sampled by version 3 (the trainer's), g2 by version 2 with other log-probs
    groups = _groups(model, lambda g, i: 3 if g == "g1" else 2)
    for r in next(g for g in groups if g.group_id == "g2").samples.values():
        r.trajectory.completion_logprobs = [x - 0.25 for x in r.trajectory.completion_logprobs]
    m = tr.train_step(groups)
    assert m["mismatch/onpolicy_tokens"] == 16.0  # g1: 4 samples x 4 tokens
    assert m["mismatch/onpolicy_abs_logp_diff"] < 1e-5 and m["mismatch/onpolicy_k3"] < 1e-9
    assert m["mismatch/abs_logp_diff"] == pytest.approx(0.25 * 12 / 28, rel=1e-3)  # g2's 12 of 28 tokens
    assert m["mismatch/k3"] > 0


def test_bf16_autocast_shows_mismatch_that_ppo_clip_takes_for_policy_change_and_decoupled_does_not(tiny):
    """Behaviour log-probs from an fp32 engine, trainer in bf16: the mismatch is measured on-policy; the PPO
    clip against the behaviour policy clips tokens at the first step (numerical noise looks like a policy
    change beyond ε), the decoupled clip against the trainer's own log-probs clips none."""
    model = load_model(tiny)
    figures = {}
    for mode in ("ppo_clip", "decoupled"):
        cfg = TrainerConfig(autocast_bf16=True, max_grad_norm=1e9,
                            loss={"kind": "grpo", "off_policy": mode, "clip_eps": 0.2})
        tr = PolicyTrainer(load_model(tiny), cfg, pad_id=0)
        tr.optimizer.step = lambda: None
        # fp32 behaviour log-probs, shifted by ±0.3 nats: the size of bf16 noise on a real model's rare tokens
        figures[mode] = tr.train_step(_groups(model, lambda g, i: 0, noise=0.3))
    for m in figures.values():
        assert m["mismatch/onpolicy_tokens"] == 28.0
        assert m["mismatch/onpolicy_abs_logp_diff"] > 0.2
    assert figures["ppo_clip"]["loss/clip_frac"] > 0.1
    assert figures["decoupled"]["loss/clip_frac"] == 0.0
    assert figures["decoupled"]["loss/is_truncated_frac"] == 0.0  # exp(0.3) < C = 2: every weight kept


def test_the_bf16_reference_keeps_a_float32_output_layer_and_close_log_probs(tiny):
    from trainer_service.trainer import reference_model

    model = load_model(tiny)
    ref = reference_model(model, bf16=True)
    assert ref.lm_head.weight.dtype == torch.float32 and ref.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32  # the policy is untouched
    assert not any(p.requires_grad for p in ref.parameters())
    rows = [scored("g", i, comp=(10 + i, 11, 12)) for i in range(3)]
    b = collate(rows, pad_id=0)
    with torch.no_grad():
        exact = completion_logprobs(model, b)
        approx = completion_logprobs(ref, b, autocast_bf16=True)
    assert approx.dtype == torch.float32
    assert 0 < (approx - exact).abs().max() < 0.1
