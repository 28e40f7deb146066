"""The policy-gradient loss families, one per file, and the presets that name them.

Each preset means what TRL and verl mean by the name (``tests/trainer_service/test_trl_parity.py``
compares each one's gradient with TRL 1.16's ``GRPOTrainer`` loss):

=========  ====================  =====================  ============  ===================================
loss       advantages            surrogate              default clip  default aggregation
=========  ====================  =====================  ============  ===================================
grpo       group mean / std      token ratio, clipped   0.2 / 0.2     seq_mean_token_mean (DeepSeekMath eq. 3)
bnpo       group mean / std      token ratio, clipped   0.2 / 0.2     token_mean
dr_grpo    group mean            token ratio, clipped   0.2 / 0.2     seq_mean_token_sum (constant L_max)
dapo       group mean / std      token ratio, clipped   0.2 / 0.28    token_mean
rloo       leave-one-out mean    token ratio, clipped   0.2 / 0.2     token_mean
gspo       group mean / std      sequence ratio         3e-4 / 4e-4   mean over sequences
=========  ====================  =====================  ============  ===================================

The TRL ``GRPOConfig`` and verl settings each preset equals:

- ``grpo``: TRL ``loss_type="grpo"``, ``scale_rewards="group"``, ``epsilon=0.2``; verl
  ``adv_estimator=grpo``, ``loss_agg_mode=seq-mean-token-mean``, ``clip_ratio=0.2``. (The std floor
  ``adv_eps`` = 1e-4 is TRL's; verl adds 1e-6.)
- ``bnpo``: TRL ``loss_type="bnpo"`` (TRL normalises each micro-batch by its own tokens, we by the
  whole batch's: equal when the step is one micro-batch) = TRL ``loss_type="dapo"`` with
  ``epsilon_high=0.2``; verl ``adv_estimator=grpo`` with its default ``loss_agg_mode=token-mean``.
  (Flywheel's ``grpo`` before issue 14.)
- ``dr_grpo``: TRL ``loss_type="dr_grpo"``, ``scale_rewards="none"``, ``max_completion_length=L_max``;
  verl ``norm_adv_by_std_in_grpo=False``, ``loss_agg_mode=seq-mean-token-sum-norm`` (verl divides by
  L_max but not by the number of sequences in ``core_algos.agg_loss``: the same direction, a constant
  factor apart).
- ``dapo``: TRL ``loss_type="dapo"`` (normalised by ``num_items_in_batch``, the batch's tokens),
  ``epsilon=0.2``, ``epsilon_high=0.28``; verl ``loss_agg_mode=token-mean``, ``clip_ratio_low=0.2``,
  ``clip_ratio_high=0.28``. DAPO's dynamic sampling and overlong shaping are ``scheduler.oversample``
  and ``truncation``.
- ``rloo``: verl ``adv_estimator=rloo`` (token-level PPO clip, ``loss_agg_mode=token-mean``); in TRL,
  ``GRPOTrainer`` ``loss_type="dapo"`` with ``epsilon_high=0.2`` fed the leave-one-out advantages.
  TRL's ``RLOOTrainer`` is another objective (one clipped ratio of the whole sequence's probability,
  the KL folded into the reward).
- ``gspo``: TRL ``importance_sampling_level="sequence"``, ``loss_type="grpo"``, ``epsilon=3e-4``,
  ``epsilon_high=4e-4``; verl ``policy_loss.loss_mode=gspo``, ``loss_agg_mode=seq-mean-token-mean``,
  ``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``.

With ``kl_coef`` = β and ``kl_estimator: k3`` the KL term is TRL's ``beta`` with
``use_bias_correction_kl=True`` (``losses/kl.py``; for GSPO with TRL's token-level weight, not the
sequence ratio TRL broadcasts), aggregated like the surrogate; verl's nearest is ``use_kl_loss=True``,
``kl_loss_type=low_var_kl`` (k3), ``kl_loss_coef=β``, whose gradient we have not compared. verl's dual
clip (``clip_ratio_c``, default 3) bounds −A·ρ for A < 0 and ρ > c; none of these presets has it
(equal while every ratio stays below c).

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
    "grpo": ("grpo", grpo_loss, 0.2, None, "seq_mean_token_mean"),
    "bnpo": ("grpo", grpo_loss, 0.2, None, "token_mean"),
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
