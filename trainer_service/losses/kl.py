"""KL to a frozen reference policy: the k1/k2/k3 estimators and a loss term whose gradient is right.

With samples y ~ π_θ and δ = log π_θ(y) − log π_ref(y) (Schulman 2020, "Approximating KL divergence"):

    k1 = δ                       unbiased for KL(π_θ ‖ π_ref), high variance, can be negative
    k2 = δ² / 2                  biased, low variance
    k3 = exp(−δ) − 1 + δ         unbiased, low variance, ≥ 0 (GRPO's choice, DeepSeekMath eq. 4)

The gradient of the reverse KL is E[δ · ∇log π_θ] (score function; the E[∇δ] part is 0). Used naively
as a loss, the estimators do not all give it (Tang & Munos 2025, "On a few pitfalls in KL divergence
gradient estimation for RL", §3-4):

- ∇k1 = ∇log π_θ has expectation 0: k1 as a loss does nothing. It is used here as a reward-like
  term sg(δ) · log π_θ, whose gradient is δ ∇log π_θ.
- ∇k2 = δ ∇log π_θ: exactly the right gradient; k2 is used as the loss.
- ∇k3 = (1 − π_ref/π_θ) ∇log π_θ, whose expectation is the gradient of the *forward* KL(π_ref ‖ π_θ).
  The term here keeps k3's value but takes the score-function gradient: k3 − sg(k3) + sg(δ)·(log π_θ
  − sg(log π_θ)).

So every estimator contributes the gradient of KL(π_θ ‖ π_ref) and reports its own value.
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["k1", "k2", "k3"]


def kl_value(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (no gradient semantics; see :func:`kl_term`)."""
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return torch.exp(-delta) - 1.0 + delta
    raise ValueError(f"unknown KL estimator {estimator!r}")


def kl_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """Per-token loss term ``[B, T]`` whose value is the estimator's and whose gradient is δ·∇log π_θ.

    Args:
        logprobs: ``[B, T]`` float, log π_θ (requires grad).
        ref_logprobs: ``[B, T]`` float, log π_ref of the same tokens (no grad).
        estimator: ``k1``, ``k2`` or ``k3``.
    """
    ref = ref_logprobs.detach()
    delta_sg = (logprobs - ref).detach()
    if estimator == "k2":
        return kl_value(logprobs, ref, "k2")
    if estimator == "k1":
        return delta_sg * logprobs - (delta_sg * logprobs).detach() + delta_sg
    value = kl_value(logprobs, ref, estimator).detach()
    return value + delta_sg * (logprobs - logprobs.detach())
