"""The policy-gradient loss families: their settings (``trainer.loss``, tagged by ``kind``), and the
loss each one resolves to.

Each ``kind`` means what TRL and verl mean by the name (``tests/trainer_service/test_trl_parity.py``
compares each one's gradient with TRL 1.16's ``GRPOTrainer`` loss); its defaults are those of its
config class in ``losses/config.py`` (``GRPOLossConfig``, ``BNPOLossConfig``, ...):

=========  ====================  =====================  ============  ===================================
kind       advantages            surrogate              default clip  default aggregation
=========  ====================  =====================  ============  ===================================
grpo       group mean / std      token ratio, clipped   0.2 / 0.2     seq_mean_token_mean (DeepSeekMath eq. 3)
bnpo       group mean / std      token ratio, clipped   0.2 / 0.2     token_mean
dr_grpo    group mean            token ratio, clipped   0.2 / 0.2     seq_mean_token_sum (constant L_max)
dapo       group mean / std      token ratio, clipped   0.2 / 0.28    token_mean
rloo       leave-one-out mean    token ratio, clipped   0.2 / 0.2     token_mean
gspo       group mean / std      sequence ratio         3e-4 / 4e-4   mean over sequences
=========  ====================  =====================  ============  ===================================

The TRL ``GRPOConfig`` and verl settings each kind equals:

- ``grpo``: TRL ``loss_type="grpo"``, ``scale_rewards="group"``, ``epsilon=0.2``; verl
  ``adv_estimator=grpo``, ``loss_agg_mode=seq-mean-token-mean``, ``clip_ratio=0.2``. (The std floor
  ``adv_eps`` = 1e-4 is TRL's; verl adds 1e-6.)
- ``bnpo``: TRL ``loss_type="bnpo"`` (TRL normalises each micro-batch by its own tokens, we by the
  whole batch's: equal when the step is one micro-batch) = TRL ``loss_type="dapo"`` with
  ``epsilon_high=0.2``; verl ``adv_estimator=grpo`` with its default ``loss_agg_mode=token-mean``.
  (Flywheel's ``grpo`` of the first releases.)
- ``dr_grpo``: TRL ``loss_type="dr_grpo"``, ``scale_rewards="none"``, ``max_completion_length=L_max``;
  verl ``norm_adv_by_std_in_grpo=False``, ``loss_agg_mode=seq-mean-token-sum-norm`` (verl divides by
  L_max but not by the number of sequences in ``core_algos.agg_loss``: the same direction, a constant
  factor apart).
- ``dapo``: TRL ``loss_type="dapo"`` (normalised by ``num_items_in_batch``, the batch's tokens),
  ``epsilon=0.2``, ``epsilon_high=0.28``; verl ``loss_agg_mode=token-mean``, ``clip_ratio_low=0.2``,
  ``clip_ratio_high=0.28``. DAPO's dynamic sampling and overlong shaping are ``budget.oversample``
  and ``trainer.truncation``.
- ``rloo``: verl ``adv_estimator=rloo`` (token-level PPO clip, ``loss_agg_mode=token-mean``); in TRL,
  ``GRPOTrainer`` ``loss_type="dapo"`` with ``epsilon_high=0.2`` fed the leave-one-out advantages.
  TRL's ``RLOOTrainer`` is another objective (one clipped ratio of the whole sequence's probability,
  the KL folded into the reward).
- ``gspo``: TRL ``importance_sampling_level="sequence"``, ``loss_type="grpo"``, ``epsilon=3e-4``,
  ``epsilon_high=4e-4``; verl ``policy_loss.loss_mode=gspo``, ``loss_agg_mode=seq-mean-token-mean``,
  ``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``.

With ``trainer.kl_coef`` = β and ``trainer.kl_estimator: k3`` the KL term is TRL's ``beta`` with
``use_bias_correction_kl=True`` (``losses/kl.py``; for GSPO with TRL's token-level weight, not the
sequence ratio TRL broadcasts), aggregated like the surrogate; verl's nearest is ``use_kl_loss=True``,
``kl_loss_type=low_var_kl`` (k3), ``kl_loss_coef=β``, whose gradient we have not compared. (The KL term
is the trainer's, not a loss setting: it applies to every kind, and β > 0 makes the trainer keep a
reference model.) verl's dual clip (``clip_ratio_c``, default 3) bounds −A·ρ for A < 0 and ρ > c; none of these kinds has it
(equal while every ratio stays below c).

Files: ``config.py`` (each kind's settings and defaults, no torch), ``advantages.py`` (estimators),
``grpo.py`` (the token-level surrogate, aggregations and off-policy corrections), ``gspo.py`` (the
sequence-level surrogate), ``kl.py`` (KL to the reference), ``output.py`` (what a loss returns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from trainer_service.losses.config import (
    BNPOLossConfig,
    DAPOLossConfig,
    DrGRPOLossConfig,
    Estimator,
    GRPOLossConfig,
    GSPOLossConfig,
    LossConfig,
    RLOOLossConfig,
    TokenLossConfig,
)
from trainer_service.losses.output import LossOutput, TokenMean

if TYPE_CHECKING:
    import torch

__all__ = ["BNPOLossConfig", "DAPOLossConfig", "DrGRPOLossConfig", "GRPOLossConfig", "GSPOLossConfig", "LossConfig",
           "LossOutput", "LossSpec", "RLOOLossConfig", "TokenLossConfig", "TokenMean", "resolve_loss"]

Surrogate = Callable[..., LossOutput]
"""``(logprobs [B, T], behaviour_logprobs [B, T], advantages [B], mask [B, T], normalizer, cfg) -> LossOutput``."""


@dataclass(frozen=True)
class LossSpec:
    """A resolved loss, chosen once when the trainer is built: which advantages, which surrogate
    function, with which settings, and how its summed statistics are reported."""

    estimator: Estimator
    """Advantage estimator (``losses/advantages.py``)."""
    surrogate: Surrogate
    """``grpo_loss`` (token ratio) or ``gspo_loss`` (sequence ratio)."""
    cfg: LossConfig
    """The family's settings: one of the :data:`LossConfig` classes."""
    metrics: Mapping[str, TokenMean]
    """``_sum`` key → reported per-token mean, for the statistics ``surrogate`` returns."""

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages of one or more groups: ``rewards`` ``[G, K]`` float64 → ``[G, K]`` float64.

        Raises:
            ValueError: fewer than 2 samples per group.
        """
        from trainer_service.losses.advantages import group_advantages
        # only the families whose estimator divides by the std have ε_std (adv_eps); the others ignore it
        return group_advantages(rewards, self.estimator, getattr(self.cfg, "adv_eps", 1e-4))

    def normalizer(self, loss_masks: list[list[int]]) -> float:
        """The loss denominator of the whole optimizer batch (``grpo.batch_normalizer``), ≥ 1."""
        from trainer_service.losses.grpo import batch_normalizer
        return batch_normalizer(loss_masks, self.cfg)


def resolve_loss(cfg: Any) -> LossSpec:
    """The :class:`LossSpec` of a loss config (or of a ``TrainerConfig``: its ``loss``).

    Imports the torch surrogates (this package's ``config`` module loads without torch).

    Raises:
        TypeError: ``cfg`` is neither a loss config nor has one as ``.loss``.
    """
    from trainer_service.losses import grpo, gspo

    loss = getattr(cfg, "loss", cfg)
    if not isinstance(loss, (TokenLossConfig, GSPOLossConfig)):
        raise TypeError(f"not a loss config: {type(loss).__name__}")
    if loss.ratio_level == "sequence":
        return LossSpec(loss.estimator, gspo.gspo_loss, loss, gspo.METRICS)
    return LossSpec(loss.estimator, grpo.grpo_loss, loss, grpo.METRICS)
