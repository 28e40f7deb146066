"""KL to a frozen reference policy: the k1/k2/k3 estimators and a loss term whose gradient is right,
on-policy and under staleness.

With δ = log π_θ(y) − log π_ref(y) (Schulman 2020, "Approximating KL divergence"):

    k1 = δ                       unbiased for KL(π_θ ‖ π_ref) when y ~ π_θ, high variance, can be negative
    k2 = δ² / 2                  biased, low variance
    k3 = exp(−δ) − 1 + δ         unbiased when y ~ π_θ, low variance, ≥ 0 (GRPO's choice, DeepSeekMath eq. 4)

The gradient of the reverse KL is E_{y~π_θ}[δ · ∇log π_θ] (score function; the E[∇δ] part is 0). Used
naively as a loss, the estimators do not all give it (Tang & Munos 2025, "On a few pitfalls in KL
divergence gradient estimation for RL", §3-4):

- ∇k1 = ∇log π_θ has expectation 0: k1 as a loss does nothing. It is used here as a reward-like
  term sg(δ) · log π_θ, whose gradient is δ ∇log π_θ.
- ∇k2 = δ ∇log π_θ: exactly the right gradient; k2 is used as the loss.
- ∇k3 = (1 − π_ref/π_θ) ∇log π_θ, whose expectation is the gradient of the *forward* KL(π_ref ‖ π_θ).
  The term here keeps k3's value but takes the score-function gradient: k3 − sg(k3) + sg(δ)·(log π_θ
  − sg(log π_θ)).

**Staleness.** With η ≥ 1 the tokens were sampled by the behaviour policy π_b, not π_θ, and both the
value and the gradient above are expectations under π_θ. Both are importance-weighted to the sampling
policy, as TRL's ``GRPOConfig.use_bias_correction_kl`` does (on by default in TRL 1.16,
``GRPOTrainer._compute_loss``: ``per_token_kl * coef_1``; TRL cites DeepSeek-AI 2025, "DeepSeek-V3.2",
arXiv:2512.02556, for this unbiased KL estimate): with w = π_θ(y) / π_b(y),

    term_t = sg(w_t) · term_t(on-policy)
    value     w_t · k_t               E_{π_b}[w·k] = E_{π_θ}[k]
    gradient  w_t · δ_t · ∇log π_θ    E_{π_b}[w·δ·∇log π_θ] = E_{π_θ}[δ·∇log π_θ] = ∇KL

(expectations over y_t given its prefix; the prefix itself still comes from π_b, the same per-token
approximation as the surrogate's token ratio).

- The weight is *detached* in our term; its gradient is nonetheless exactly TRL's, whose k3 term is
  k3 · w with w *not* detached: ∇(w · k3) = w · (k3 + 1 − e^{−δ}) · ∇log π_θ = w · δ · ∇log π_θ.
- The weight is *not truncated* (TRL does not truncate it either): a truncation at C would bias the
  KL towards π_b's. The trainer reports its mean as ``loss/kl_ref_weight_mean``.
- The weight is per token, w_t = exp(log π_θ(y_t) − log π_b(y_t)), for every loss, GSPO included: it
  makes each token's term consistent given its prefix. (TRL with ``importance_sampling_level=
  "sequence"`` broadcasts GSPO's sequence ratio onto the per-token KL instead, and its own docstring says
  the unbiased property then no longer holds; the parity test composes GSPO's surrogate with TRL's
  token-level KL.)
- On-policy (π_b = π_θ) w is exactly 1.0 and every term is bit-for-bit the on-policy term.
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


def kl_importance_weight(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The detached importance weight w_t = π_θ(y_t) / π_behaviour(y_t) of each token, ``[B, T]``.

    Args:
        logprobs: ``[B, T]`` float, log π_θ.
        behaviour_logprobs: ``[B, T]`` float, log-probs recorded by the rollout engine (π_b).
        mask: ``[B, T]``, 1 on tokens that train; masked tokens get weight exactly 1.

    Returns:
        ``[B, T]``, dtype of ``logprobs``, no gradient, untruncated; exactly 1.0 where
        ``logprobs == behaviour_logprobs``.
    """
    with torch.no_grad():
        return torch.exp((logprobs - behaviour_logprobs.to(logprobs.dtype)) * mask.to(logprobs.dtype))


def kl_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Estimator,
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss term ``[B, T]`` whose value is w · (the estimator's) and whose gradient is w·δ·∇log π_θ.

    Args:
        logprobs: ``[B, T]`` float, log π_θ (requires grad).
        ref_logprobs: ``[B, T]`` float, log π_ref of the same tokens (no grad).
        estimator: ``k1``, ``k2`` or ``k3``.
        weight: ``[B, T]`` float, the importance weight π_θ/π_behaviour of each token
            (:func:`kl_importance_weight`; detached here); ``None`` = 1 (samples from π_θ).

    Returns:
        ``[B, T]``, same dtype as ``logprobs``; aggregate it over the mask like the surrogate.
    """
    ref = ref_logprobs.detach()
    delta_sg = (logprobs - ref).detach()
    if estimator == "k2":
        term = kl_value(logprobs, ref, "k2")
    elif estimator == "k1":
        term = delta_sg * logprobs - (delta_sg * logprobs).detach() + delta_sg
    else:
        value = kl_value(logprobs, ref, estimator).detach()
        term = value + delta_sg * (logprobs - logprobs.detach())
    if weight is None:
        return term
    return weight.detach().to(term.dtype) * term
