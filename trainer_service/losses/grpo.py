"""GRPO: group-normalised advantages with a PPO-style clipped importance ratio.

Formula (Shao et al. 2024, "DeepSeekMath", eq. 3, with the token-level aggregation of DAPO,
Yu et al. 2025, §3.3):

    A_i      = (r_i − mean(r_group)) / (std(r_group) + ε_std)
    ρ_t      = exp(log π_θ(y_t) − log π_behaviour(y_t))
    ℓ_t      = −min(ρ_t · A_i, clip(ρ_t, 1 − ε, 1 + ε) · A_i)
    loss     = Σ_i Σ_t mask_it · ℓ_it / N_tokens                      (loss_agg = "token_mean", DAPO)
    loss     = Σ_i (Σ_t mask_it · ℓ_it / |o_i|) / N_sequences          (loss_agg = "seq_mean_token_mean",
                                                                        DeepSeekMath eq. 3; TRL loss_type="grpo")

``N_tokens`` (unmasked completion tokens) or ``N_sequences`` is counted over the *whole* optimizer
batch and passed in as ``normalizer``, so the gradient does not depend on how the batch is cut into
micro-batches (:func:`batch_normalizer`). std is the unbiased (Bessel-corrected) group std, as in
TRL's GRPOTrainer.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class GRPOLossConfig(BaseModel):
    """Settings of the GRPO loss."""

    model_config = ConfigDict(extra="forbid")
    clip_eps: float = Field(0.2, gt=0)
    """ε of the clipped ratio."""
    adv_eps: float = Field(1e-4, gt=0)
    """ε_std added to the group std (bounds advantages of near-constant groups)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """``token_mean``: every token of the batch weighs the same (DAPO). ``seq_mean_token_mean``: mean over
    each sequence's tokens, then over sequences (the original GRPO; short answers weigh more per token)."""


def batch_normalizer(loss_masks: list[list[int]], cfg: GRPOLossConfig) -> float:
    """The loss denominator of a whole optimizer batch: unmasked tokens, or sequences (≥ 1)."""
    if cfg.loss_agg == "token_mean":
        return max(1.0, float(sum(sum(m) for m in loss_masks)))
    return max(1.0, float(len(loss_masks)))


def group_advantages(rewards: torch.Tensor, adv_eps: float) -> torch.Tensor:
    """Group-normalised advantages.

    Args:
        rewards: ``[G, K]`` float rewards, one row per group of K samples (K ≥ 2).
        adv_eps: ε_std added to the std before dividing.

    Returns:
        ``[G, K]`` advantages, same dtype. A group with identical rewards gets exactly 0.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    centred = rewards - mean
    # exact zeros for zero-variance groups (mean subtraction can leave ±1 ulp otherwise)
    centred = torch.where(std == 0, torch.zeros_like(centred), centred)
    return centred / (std + adv_eps)


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    cfg: GRPOLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of one micro-batch.

    Args:
        logprobs: ``[B, T]`` float, log π_θ of each completion token (requires grad).
        behaviour_logprobs: ``[B, T]`` float, log-probs recorded by the rollout engine.
        advantages: ``[B]`` float, one per trajectory.
        mask: ``[B, T]`` float/bool, 1 on tokens that train (0 on padding and tool output).
        normalizer: :func:`batch_normalizer` of the whole optimizer batch (> 0).
        cfg: clip settings.

    Returns:
        ``(loss, metrics)``: a scalar tensor (this micro-batch's share of the batch loss) and
        sums over the micro-batch's unmasked tokens, to be added across micro-batches and divided
        by the batch's token count: ``loss/clip_frac_sum``, ``loss/kl_behaviour_sum`` (k1: log π_b − log π_θ),
        ``loss/ratio_sum``.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behaviour_logprobs) * mask  # masked tokens get ratio exactly 1
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if cfg.loss_agg == "token_mean":
        loss = (per_token * mask).sum() / normalizer
    else:
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        loss = per_seq.sum() / normalizer
    with torch.no_grad():
        was_clipped = ((unclipped - clipped).abs() > 0).to(mask.dtype) * mask
        metrics = {
            "loss/clip_frac_sum": float(was_clipped.sum()),
            "loss/kl_behaviour_sum": float((-log_ratio * mask).sum()),
            "loss/ratio_sum": float((ratio * mask).sum()),
        }
    return loss, metrics
