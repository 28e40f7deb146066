"""The settings of each loss family: one pydantic class per ``kind``, each with that family's defaults.

``trainer.loss`` is :data:`LossConfig`, a union tagged by ``kind``; a plain string is its shorthand
(``loss: bnpo`` means ``loss: {kind: bnpo}``). A family's class lists every setting it has and no
other: a field of another family, or an unknown ``kind``, is a validation error naming it.

==========  =========================  ==========  ====================  ==================================
kind        class                      advantages  clip (low / high)     aggregation (default)
==========  =========================  ==========  ====================  ==================================
grpo        :class:`GRPOLossConfig`    grpo        0.2 / 0.2             seq_mean_token_mean
bnpo        :class:`BNPOLossConfig`    grpo        0.2 / 0.2             token_mean
dr_grpo     :class:`DrGRPOLossConfig`  dr_grpo     0.2 / 0.2             seq_mean_token_sum (÷ L_max)
dapo        :class:`DAPOLossConfig`    grpo        0.2 / 0.28            token_mean
rloo        :class:`RLOOLossConfig`    rloo        0.2 / 0.2             token_mean
gspo        :class:`GSPOLossConfig`    grpo        3e-4 / 4e-4           mean over sequences (fixed)
==========  =========================  ==========  ====================  ==================================

The first five train the token-level clipped surrogate (formula, aggregations and off-policy
corrections: ``losses/grpo.py``), GSPO the sequence-level one (``losses/gspo.py``); the advantage
estimators are in ``losses/advantages.py``; ``losses/__init__.py`` says which TRL and verl settings each
kind equals. The KL term to the reference model is not a loss setting: it applies to every family and
decides whether the trainer keeps a reference model, so ``kl_coef`` and ``kl_estimator`` stay in the
``trainer`` section (``trainer_service/config.py``, ``losses/kl.py``).

This module imports no torch (the configuration loads without it); the loss functions do.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
"""How per-token terms become the batch loss (``losses/grpo.py``)."""
OffPolicy = Literal["ppo_clip", "decoupled", "tis"]
"""Correction for samples of older policies (``losses/grpo.py``)."""
Estimator = Literal["grpo", "dr_grpo", "rloo"]
"""Advantage estimator over a group (``losses/advantages.py``)."""
RatioLevel = Literal["token", "sequence"]
"""Where the importance ratio is taken (TRL's ``importance_sampling_level``)."""


class _ClippedLossConfig(BaseModel):
    """The clip range every family has (ε_low / ε_high of a PPO-style clipped ratio)."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    """The family (each subclass narrows it to its own name)."""
    clip_eps: float = Field(0.2, gt=0, le=10.0)
    """ε_low: the ratio is clipped below at 1 − ε_low (TRL ``epsilon``, verl ``clip_ratio_low``)."""
    clip_eps_high: float | None = Field(None, gt=0, le=10.0)
    """ε_high: the ratio is clipped above at 1 + ε_high (DAPO's clip-higher when > ε_low; TRL
    ``epsilon_high``, verl ``clip_ratio_high``); ``None`` = ε_low (the symmetric PPO clip)."""

    estimator: ClassVar[Estimator] = "grpo"
    """The family's advantage estimator (``losses/advantages.py``)."""
    ratio_level: ClassVar[RatioLevel] = "token"
    """``token``: ``grpo_loss`` (``losses/grpo.py``); ``sequence``: ``gspo_loss`` (``losses/gspo.py``)."""

    @property
    def eps_high(self) -> float:
        """ε_high in effect (``clip_eps_high``, else ε_low)."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


class TokenLossConfig(_ClippedLossConfig):
    """Settings of the token-level clipped surrogate (``losses/grpo.py``), shared by ``grpo``, ``bnpo``,
    ``dr_grpo``, ``dapo`` and ``rloo``; each of those sets ``kind`` and its own defaults."""

    loss_agg: Aggregation = "token_mean"
    """Aggregation over the optimizer batch (``losses/grpo.py``): ``token_mean`` (DAPO §3.3; TRL "dapo",
    "bnpo"; verl ``token-mean``), ``seq_mean_token_mean`` (mean per sequence, then over sequences;
    DeepSeekMath eq. 3; TRL "grpo"; verl ``seq-mean-token-mean``) or ``seq_mean_token_sum`` (token sum
    over a constant sequences × L_max; Dr. GRPO; TRL "dr_grpo"; verl ``seq-mean-token-sum-norm``)."""
    max_response_tokens: int = Field(1024, ge=1)
    """L_max: the generation budget used by Dr. GRPO's constant normaliser (``seq_mean_token_sum``; TRL's
    ``max_completion_length``)."""
    off_policy: OffPolicy = "ppo_clip"
    """Correction for samples of older policies: clip against the behaviour policy, decoupled PPO
    (clip against the trainer's own pre-step policy, times a truncated importance weight), or
    truncated importance sampling. See ``losses/grpo.py``."""
    is_cap: float = Field(2.0, ge=1.0)
    """C, the cap of the truncated importance weight π/π_behaviour (``decoupled``, ``tis``)."""


class GRPOLossConfig(TokenLossConfig):
    """``grpo``: group mean / std advantages, the token ratio clipped at 1 ± 0.2, mean per sequence then
    over sequences (Shao et al. 2024, "DeepSeekMath", eq. 3). TRL ``loss_type="grpo"``,
    ``scale_rewards="group"``, ``epsilon=0.2``; verl ``adv_estimator=grpo``,
    ``loss_agg_mode=seq-mean-token-mean``, ``clip_ratio=0.2``."""

    kind: Literal["grpo"] = "grpo"
    """The family."""
    loss_agg: Aggregation = "seq_mean_token_mean"
    """Aggregation (see :class:`TokenLossConfig`); GRPO's is the mean per sequence, then over sequences."""
    adv_eps: float = Field(1e-4, gt=0)
    """ε_std: floor added to the group reward std before dividing (keeps near-constant groups bounded;
    TRL's 1e-4, verl adds 1e-6)."""


class BNPOLossConfig(GRPOLossConfig):
    """``bnpo``: GRPO's advantages and clip, the mean over the whole batch's tokens. TRL
    ``loss_type="bnpo"`` (TRL normalises each micro-batch by its own tokens, we by the whole batch's:
    equal when the step is one micro-batch) = TRL ``loss_type="dapo"`` with ``epsilon_high=0.2``; verl
    ``adv_estimator=grpo`` with its default ``loss_agg_mode=token-mean``. (Flywheel's ``grpo`` of the
    first releases.)"""

    kind: Literal["bnpo"] = "bnpo"
    """The family."""
    loss_agg: Aggregation = "token_mean"
    """Aggregation (see :class:`TokenLossConfig`); BNPO's is the token mean over the batch."""


class DAPOLossConfig(GRPOLossConfig):
    """``dapo``: GRPO's advantages, clip-higher (ε_high = 0.28 > ε_low = 0.2; Yu et al. 2025, "DAPO",
    §3.1), token mean over the batch (§3.3). TRL ``loss_type="dapo"`` (normalised by
    ``num_items_in_batch``, the batch's tokens), ``epsilon=0.2``, ``epsilon_high=0.28``; verl
    ``loss_agg_mode=token-mean``, ``clip_ratio_low=0.2``, ``clip_ratio_high=0.28``. DAPO's dynamic
    sampling and overlong shaping are ``budget.oversample`` and ``trainer.truncation`` (``penalise``)."""

    kind: Literal["dapo"] = "dapo"
    """The family."""
    clip_eps_high: float | None = Field(0.28, gt=0, le=10.0)
    """ε_high: DAPO's clip-higher (0.28); ``None`` = ε_low (the symmetric PPO clip)."""
    loss_agg: Aggregation = "token_mean"
    """Aggregation (see :class:`TokenLossConfig`); DAPO's is the token mean over the batch."""


class DrGRPOLossConfig(TokenLossConfig):
    """``dr_grpo``: advantages without the std division, token sum over the constant sequences × L_max
    (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", §3.1). TRL
    ``loss_type="dr_grpo"``, ``scale_rewards="none"``, ``max_completion_length=L_max``; verl
    ``norm_adv_by_std_in_grpo=False``, ``loss_agg_mode=seq-mean-token-sum-norm`` (verl divides by L_max
    but not by the number of sequences in ``core_algos.agg_loss``: the same direction, a constant
    factor apart)."""

    kind: Literal["dr_grpo"] = "dr_grpo"
    """The family."""
    loss_agg: Aggregation = "seq_mean_token_sum"
    """Aggregation (see :class:`TokenLossConfig`); Dr. GRPO's divides the token sum by sequences × L_max."""

    estimator: ClassVar[Estimator] = "dr_grpo"


class RLOOLossConfig(TokenLossConfig):
    """``rloo``: the leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics", eq. 6), the token
    ratio clipped at 1 ± 0.2, token mean over the batch. verl ``adv_estimator=rloo`` (token-level PPO
    clip, ``loss_agg_mode=token-mean``); in TRL, ``GRPOTrainer`` ``loss_type="dapo"`` with
    ``epsilon_high=0.2`` fed the leave-one-out advantages. TRL's ``RLOOTrainer`` is another objective (one
    clipped ratio of the whole sequence's probability, the KL folded into the reward)."""

    kind: Literal["rloo"] = "rloo"
    """The family."""
    loss_agg: Aggregation = "token_mean"
    """Aggregation (see :class:`TokenLossConfig`); RLOO's is the token mean over the batch."""

    estimator: ClassVar[Estimator] = "rloo"


class GSPOLossConfig(_ClippedLossConfig):
    """``gspo``: GRPO's advantages, one length-normalised importance ratio per sequence, clipped at
    1 − 3e-4 / 1 + 4e-4, mean over sequences (Zheng et al. 2025, "Group Sequence Policy Optimization",
    eq. 5-7; ``losses/gspo.py``). TRL ``importance_sampling_level="sequence"``, ``loss_type="grpo"``,
    ``epsilon=3e-4``, ``epsilon_high=4e-4``; verl ``policy_loss.loss_mode=gspo``,
    ``loss_agg_mode=seq-mean-token-mean``, ``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``. It has no
    aggregation setting (its normaliser is the number of sequences) and no off-policy setting (the
    sequence ratio against the behaviour policy is its correction)."""

    kind: Literal["gspo"] = "gspo"
    """The family."""
    clip_eps: float = Field(3e-4, gt=0, le=10.0)
    """ε_low of the sequence ratio (the paper's 3e-4: the ratio is a geometric mean, so the range is tiny)."""
    clip_eps_high: float | None = Field(4e-4, gt=0, le=10.0)
    """ε_high of the sequence ratio (the paper's 4e-4); ``None`` = ε_low."""
    adv_eps: float = Field(1e-4, gt=0)
    """ε_std: floor added to the group reward std before dividing (as :class:`GRPOLossConfig`)."""

    ratio_level: ClassVar[RatioLevel] = "sequence"

    @property
    def loss_agg(self) -> Aggregation:
        """Always ``seq_mean_token_mean``: GSPO averages sequences (its KL term is aggregated the same way)."""
        return "seq_mean_token_mean"


def _shorthand(value: Any) -> Any:
    """``"dapo"`` → ``{"kind": "dapo"}`` (the YAML ``loss: dapo``); a mapping without ``kind`` is of the
    default kind, ``grpo`` (an override of one field when the file names no loss); anything else is left
    to the union."""
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": "grpo", **value}
    return value


LossConfig = Annotated[
    Union[GRPOLossConfig, BNPOLossConfig, DrGRPOLossConfig, DAPOLossConfig, RLOOLossConfig, GSPOLossConfig],
    Field(discriminator="kind"),
    BeforeValidator(_shorthand),
]
"""One loss family's settings, tagged by ``kind``; a bare string is ``{kind: <string>}``."""
