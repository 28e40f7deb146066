"""GSPO: a sequence-level importance ratio, clipped per sequence (Zheng et al. 2025, "Group Sequence
Policy Optimization", eq. 5-7).

    s_i   = exp( (1/|o_i|) Σ_t m_it (log π_θ(y_it) − log π_behaviour(y_it)) )     (length-normalised)
    ℓ_i   = −min(s_i · A_i, clip(s_i, 1 − ε_low, 1 + ε_high) · A_i)
    loss  = Σ_i ℓ_i / N_sequences

The gradient of s_i is s_i/|o_i| · Σ_t ∇log π_θ(y_it): every token of a sequence gets the same weight,
and a sequence is clipped as a whole. The paper's ranges are tiny (ε_low = 3e-4, ε_high = 4e-4)
because the ratio is a geometric mean. Advantages are GRPO's (group mean and std). Settings and
defaults: ``GSPOLossConfig`` in ``losses/config.py``.
"""

from __future__ import annotations

import torch

from trainer_service.losses.config import GSPOLossConfig
from trainer_service.losses.grpo import METRICS as _TOKEN_METRICS
from trainer_service.losses.output import LossOutput, TokenMean

METRICS: dict[str, TokenMean] = _TOKEN_METRICS
"""The statistics :func:`gspo_loss` sums: the same as ``grpo_loss`` (``losses/grpo.py``)."""


def gspo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    cfg: GSPOLossConfig,
) -> LossOutput:
    """Sequence-level clipped loss of one micro-batch.

    Args:
        logprobs: ``[B, T]`` float, log π_θ (requires grad).
        behaviour_logprobs: ``[B, T]`` float, the rollout's log-probs.
        advantages: ``[B]`` float.
        mask: ``[B, T]``, 1 on tokens that train.
        normalizer: sequences in the whole optimizer batch (``batch_normalizer`` with a
            sequence aggregation), > 0.
        cfg: ``clip_eps`` / ``clip_eps_high`` are ε_low / ε_high of the sequence ratio.

    Returns:
        :class:`LossOutput`: a scalar tensor of ``logprobs``' dtype and the same token sums as
        ``grpo_loss`` (:data:`METRICS`; a clipped sequence counts all its tokens as clipped, the
        importance weight is the untruncated token ratio, and no token counts as truncated).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behaviour_logprobs) * mask
    lengths = mask.sum(1).clamp(min=1.0)
    seq_ratio = torch.exp(log_ratio.sum(1) / lengths)
    adv = advantages.to(logprobs.dtype)
    unclipped = seq_ratio * adv
    clipped = torch.clamp(seq_ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high) * adv
    loss = -torch.minimum(unclipped, clipped).sum() / normalizer
    with torch.no_grad():
        was_clipped = ((unclipped - clipped).abs() > 0).to(mask.dtype)
        token_ratio = torch.exp(log_ratio)
        metrics = {
            "loss/clip_frac_sum": float((was_clipped[:, None] * mask).sum()),
            "loss/kl_behaviour_sum": float((-log_ratio * mask).sum()),
            "loss/ratio_sum": float((token_ratio * mask).sum()),
            "loss/is_weight_sum": float((token_ratio * mask).sum()),
            "loss/is_truncated_sum": 0.0,
        }
    return LossOutput(loss, metrics)
