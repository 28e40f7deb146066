"""The policy-gradient loss families, one per file, and the presets that name them.

=========  ====================  =====================  ====================  ==================================
loss       advantages            surrogate              default clip          default aggregation
=========  ====================  =====================  ====================  ==================================
grpo       group mean / std      token ratio, clipped   0.2 / 0.2             token_mean
dr_grpo    group mean            token ratio, clipped   0.2 / 0.2             seq_mean_token_sum (constant L_max)
dapo       group mean / std      token ratio, clipped   0.2 / 0.28            token_mean
rloo       leave-one-out mean    token ratio, clipped   0.2 / 0.2             token_mean
gspo       group mean / std      sequence ratio         3e-4 / 4e-4           mean over sequences
=========  ====================  =====================  ====================  ==================================

Files: ``advantages.py`` (estimators), ``grpo.py`` (the token-level surrogate, aggregations and
off-policy corrections), ``gspo.py`` (the sequence-level surrogate), ``kl.py`` (KL to the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainer_service.losses.advantages import Estimator
from trainer_service.losses.grpo import GRPOLossConfig, grpo_loss
from trainer_service.losses.gspo import gspo_loss

_PRESETS = {  # loss: (estimator, surrogate, clip low, clip high, aggregation)
    "grpo": ("grpo", grpo_loss, 0.2, None, "token_mean"),
    "dr_grpo": ("dr_grpo", grpo_loss, 0.2, None, "seq_mean_token_sum"),
    "dapo": ("grpo", grpo_loss, 0.2, 0.28, "token_mean"),
    "rloo": ("rloo", grpo_loss, 0.2, None, "token_mean"),
    "gspo": ("grpo", gspo_loss, 3e-4, 4e-4, "seq_mean_token_mean"),
}


@dataclass(frozen=True)
class LossSpec:
    """A resolved loss: which advantages, which surrogate function, with which settings."""

    estimator: Estimator
    surrogate: Callable
    cfg: GRPOLossConfig


def resolve_loss(tc) -> LossSpec:
    """The :class:`LossSpec` of a ``TrainerConfig``: its loss preset, overridden by the fields it sets.

    Raises:
        ValueError: an unknown loss name.
    """
    if tc.loss not in _PRESETS:
        raise ValueError(f"unknown loss {tc.loss!r}; choose one of {sorted(_PRESETS)}")
    estimator, surrogate, lo, hi, agg = _PRESETS[tc.loss]
    if tc.loss == "gspo":
        agg = "seq_mean_token_mean"  # its normaliser is the number of sequences, whatever is asked
    elif tc.loss_agg is not None:
        agg = tc.loss_agg
    cfg = GRPOLossConfig(
        clip_eps=tc.clip_eps if tc.clip_eps is not None else lo,
        clip_eps_high=tc.clip_eps_high if tc.clip_eps_high is not None else hi,
        adv_eps=tc.adv_eps, loss_agg=agg, max_response_tokens=tc.max_response_tokens,
        off_policy=tc.off_policy, is_cap=tc.is_cap,
    )
    return LossSpec(estimator, surrogate, cfg)
