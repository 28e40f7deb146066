"""Advantage estimators over groups of K samples of the same prompt (pure functions on ``[G, K]`` rewards).

- ``grpo``: ``A_i = (r_i − mean(r)) / (std(r) + ε_std)``, std Bessel-corrected as in TRL's GRPOTrainer
  (Shao et al. 2024, "DeepSeekMath", §4.1.2). ``ε_std`` is a floor: a near-constant group (rewards
  0.35 × 7 and 0.35 + 1e-7) gets advantages of order 1e-3, not the ~1e0 that dividing by its own
  1e-8 std would give.
- ``dr_grpo``: ``A_i = r_i − mean(r)``, no division by the std (Liu et al. 2025, "Understanding
  R1-Zero-Like Training: A Critical Perspective", §3.1: the std favours near-solved and
  near-impossible prompts).
- ``rloo``: ``A_i = r_i − mean_{j≠i}(r_j) = K/(K−1) · (r_i − mean(r))``, the leave-one-out baseline
  (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization", eq. 6).

Every estimator gives exactly 0 for a group whose rewards are all equal (a zero-variance group).
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo"]


def group_advantages(rewards: torch.Tensor, estimator: Estimator = "grpo", std_eps: float = 1e-4) -> torch.Tensor:
    """Advantages of each sample against its group.

    Args:
        rewards: ``[G, K]`` float (float64 recommended), one row per group, K ≥ 2.
        estimator: ``grpo``, ``dr_grpo`` or ``rloo`` (see the module docstring).
        std_eps: ε_std added to the group std (``grpo`` only), > 0.

    Returns:
        ``[G, K]`` advantages, same dtype; exactly 0 in every group with equal rewards.

    Raises:
        ValueError: fewer than 2 samples per group, or an unknown estimator.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [G, K] with K >= 2, got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    centred = rewards - mean
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    # exact zeros for zero-variance groups (mean subtraction can leave ±1 ulp otherwise)
    centred = torch.where(constant, torch.zeros_like(centred), centred)
    if estimator == "grpo":
        return centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + std_eps)
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        k = rewards.shape[1]
        return centred * (k / (k - 1))
    raise ValueError(f"unknown advantage estimator {estimator!r}")
