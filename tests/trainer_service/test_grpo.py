import math

import pytest
import torch

from trainer_service.losses.advantages import group_advantages
from trainer_service.losses.config import GRPOLossConfig
from trainer_service.losses.grpo import grpo_loss


def test_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]], dtype=torch.float64) / (std + 1e-4)
    torch.testing.assert_close(group_advantages(r, "grpo", 1e-4), expected)


def test_constant_group_gets_exact_zero_and_near_constant_is_bounded():
    assert torch.equal(group_advantages(torch.ones(1, 4), "grpo", 1e-4), torch.zeros(1, 4))
    r = torch.tensor([[0.35] * 7 + [0.35 + 1e-7]], dtype=torch.float64)
    assert group_advantages(r, "grpo", 1e-4).abs().max() < 0.01


def test_grpo_loss_matches_hand_computed_example():
    cfg = GRPOLossConfig(clip_eps=0.2, loss_agg="token_mean")
    # two trajectories, two tokens each; second token of row 1 masked
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.5], [-0.2, -1.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = grpo_loss(lp, old, adv, mask, normalizer=3.0, cfg=cfg)
    # row0 t0: ratio 1 -> -1*1 = -1 ; row0 t1: ratio e^0.5=1.6487 clipped to 1.2 for A>0 -> -min(1.6487,1.2)=-1.2
    # row1 t0: ratio e^-0.3=0.7408, A=-2: unclipped -1.4816, clipped 0.8*-2=-1.6 -> -min = 1.6
    expected = (-1.0 - 1.2 + 1.6) / 3.0
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)
    assert m["loss/clip_frac_sum"] == 2.0
    loss.backward()
    # gradient flows only through unclipped tokens: d/dlp of -ratio*A = -ratio*A
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0 / 3, 0.0], [0.0, 0.0]]))


def test_masked_tokens_change_neither_loss_nor_gradient():
    cfg = GRPOLossConfig(loss_agg="token_mean")
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv = torch.tensor([0.7])
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    results = []
    for middle in (-1.0, -9.0):
        lp = torch.tensor([[-0.9, middle, -1.1]], requires_grad=True)
        loss, _ = grpo_loss(lp, old, adv, mask, 2.0, cfg)
        loss.backward()
        results.append((float(loss.detach()), lp.grad.clone()))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][1][0, 1] == 0


def test_seq_mean_aggregation_matches_hand_computed_example():
    cfg = GRPOLossConfig(clip_eps=0.2, loss_agg="seq_mean_token_mean")
    lp = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = lp.detach().clone()  # ratio 1 everywhere
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(lp, old, adv, mask, normalizer=2.0, cfg=cfg)
    # row 0: mean of three tokens of -1*1 = -1 ; row 1: one token of -(-2)*1 = 2 ; mean over 2 sequences
    assert float(loss.detach()) == pytest.approx((-1.0 + 2.0) / 2.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]]))
