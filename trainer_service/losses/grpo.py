"""The token-level clipped surrogate shared by GRPO, BNPO, Dr. GRPO, DAPO and RLOO (they differ in the
advantage estimator, ``losses/advantages.py``, in the clip range and in the aggregation; each family's
settings and defaults: ``losses/config.py``).

Formula (Shao et al. 2024, "DeepSeekMath", eq. 3; PPO, Schulman et al. 2017, eq. 7):

    ρ_t      = exp(log π_θ(y_t) − log π_behaviour(y_t))
    ℓ_t      = −min(ρ_t · A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A_i)

``ε_high > ε_low`` is DAPO's clip-higher (Yu et al. 2025, "DAPO", §3.1). Aggregation over the
optimizer batch (``N`` is counted over the *whole* batch and passed in as ``normalizer``, so the
gradient does not depend on the micro-batch split, :func:`batch_normalizer`):

    token_mean           Σ_i Σ_t m_it ℓ_it / N_tokens                 (DAPO §3.3; TRL "dapo", "bnpo")
    seq_mean_token_mean  Σ_i (Σ_t m_it ℓ_it / |o_i|) / N_sequences    (DeepSeekMath eq. 3; TRL "grpo")
    seq_mean_token_sum   Σ_i Σ_t m_it ℓ_it / (N_sequences · L_max)     (Dr. GRPO, Liu et al. 2025 §3.1:
                                                                       a constant, not the length)

Off-policy correction for asynchronous samples (``off_policy``):

    ppo_clip   the ratio above, against the behaviour policy that sampled the tokens.
    decoupled  decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
               AReaL, Fu et al. 2025, eq. 5): the clip is taken against the proximal policy π_prox
               (the trainer's weights before this step: ``logprobs.detach()``, since each batch gets
               one optimizer step) and the whole term is weighted by the truncated importance weight
               w_t = min(π_prox / π_behaviour, C), detached.
    tis        truncated importance sampling (Ionides 2008; "Your efficient RL framework secretly
               brings you off-policy RL training", Yao et al. 2025): ℓ_t = −min(ρ_t, C)·A_i·log π_θ with
               the weight detached (a REINFORCE gradient, no clipping).
"""

from __future__ import annotations

import torch

from trainer_service.losses.config import Aggregation, GSPOLossConfig, TokenLossConfig
from trainer_service.losses.output import LossOutput, TokenMean

METRICS: dict[str, TokenMean] = {
    "loss/clip_frac_sum": TokenMean("loss/clip_frac"),
    "loss/kl_behaviour_sum": TokenMean("loss/kl_behaviour"),
    "loss/ratio_sum": TokenMean("loss/ratio_mean", empty=1.0),
    "loss/is_weight_sum": TokenMean("loss/is_weight_mean", empty=1.0),
    "loss/is_truncated_sum": TokenMean("loss/is_truncated_frac"),
}
"""The statistics :func:`grpo_loss` (and ``gspo_loss``) sum, and the per-token means the trainer reports:
the fraction of clipped tokens, the k1 estimate of KL(π_behaviour ‖ π_θ) (nats per token), the mean ratio
π_θ/π_behaviour, the mean truncated importance weight and the fraction of tokens whose ratio exceeds the cap."""


def batch_normalizer(loss_masks: list[list[int]], cfg: TokenLossConfig | GSPOLossConfig) -> float:
    """The loss denominator of a whole optimizer batch, as ``cfg.loss_agg`` prescribes (a float ≥ 1).

    Args:
        loss_masks: one 0/1 list per training row of the batch (rows skipped for a zero advantage included).
        cfg: its ``loss_agg`` (and ``max_response_tokens`` for ``seq_mean_token_sum``).

    Returns:
        ``token_mean``: the unmasked tokens; ``seq_mean_token_mean``: the sequences;
        ``seq_mean_token_sum``: sequences × L_max.
    """
    if cfg.loss_agg == "token_mean":
        return max(1.0, float(sum(sum(m) for m in loss_masks)))
    if cfg.loss_agg == "seq_mean_token_sum":
        return max(1.0, float(len(loss_masks) * cfg.max_response_tokens))
    return max(1.0, float(len(loss_masks)))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalizer: float, agg: Aggregation) -> torch.Tensor:
    """Sum ``per_token`` ``[B, T]`` float over the tokens of ``mask`` ``[B, T]`` float (0/1) as ``agg``
    prescribes (each sequence's mean first for ``seq_mean_token_mean``), divided by ``normalizer``: a
    scalar of ``per_token``'s dtype."""
    if agg == "seq_mean_token_mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum() / normalizer
    return (per_token * mask).sum() / normalizer


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    cfg: TokenLossConfig,
) -> LossOutput:
    """Clipped policy-gradient loss of one micro-batch.

    Args:
        logprobs: ``[B, T]`` float, log π_θ of each completion token (requires grad).
        behaviour_logprobs: ``[B, T]`` float, log-probs recorded by the rollout engine.
        advantages: ``[B]`` float, one per trajectory.
        mask: ``[B, T]`` float/bool, 1 on tokens that train (0 on padding, prompt and tool output:
            those tokens enter neither the loss nor any ratio statistic).
        normalizer: :func:`batch_normalizer` of the whole optimizer batch (> 0).
        cfg: clip, aggregation and off-policy settings (any token-level family's config).

    Returns:
        :class:`LossOutput`: a scalar tensor of ``logprobs``' dtype (this micro-batch's share of the
        batch loss) and sums over the micro-batch's unmasked tokens, to be added across micro-batches
        and divided by the batch's token count (:data:`METRICS`): ``loss/clip_frac_sum``,
        ``loss/kl_behaviour_sum`` (k1: log π_b − log π_θ), ``loss/ratio_sum``, ``loss/is_weight_sum``,
        ``loss/is_truncated_sum``.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behaviour_logprobs) * mask  # masked tokens: ratio exactly 1, never clipped
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
    with torch.no_grad():
        behaviour_ratio = torch.exp(log_ratio)
        is_weight = torch.clamp(behaviour_ratio, max=cfg.is_cap)
    if cfg.off_policy == "tis":
        per_token = -is_weight * adv * logprobs
        was_clipped = torch.zeros_like(mask)
    else:
        if cfg.off_policy == "decoupled":
            ratio = torch.exp((logprobs - logprobs.detach()) * mask)  # against π_prox: 1 in value, ∇ = ∇log π
            weight = is_weight
        else:
            ratio = torch.exp(log_ratio)
            weight = torch.ones_like(is_weight)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, lo, hi) * adv
        per_token = -weight * torch.minimum(unclipped, clipped)
        was_clipped = (unclipped - clipped).abs() > 0
    loss = aggregate(per_token, mask, normalizer, cfg.loss_agg)
    with torch.no_grad():
        metrics = {
            "loss/clip_frac_sum": float((was_clipped.to(mask.dtype) * mask).sum()),
            "loss/kl_behaviour_sum": float((-log_ratio * mask).sum()),
            "loss/ratio_sum": float((behaviour_ratio * mask).sum()),
            "loss/is_weight_sum": float((is_weight * mask).sum()),
            "loss/is_truncated_sum": float(((behaviour_ratio > cfg.is_cap).to(mask.dtype) * mask).sum()),
        }
    return LossOutput(loss, metrics)
