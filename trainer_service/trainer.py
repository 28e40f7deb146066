"""The policy trainer: one optimizer step of a GRPO-family loss over complete groups.

A step (:meth:`PolicyTrainer.train_step`) reads top to bottom in named phases, one method each:

1. ``_plan``: truncation policy → advantages (``losses/advantages.py``) → the rows that train, sorted
   so that a group shares a micro-batch → the whole batch's normaliser (token or sequence count) → the
   rows that go through the model (rows whose advantage is exactly 0 are skipped when there is no KL
   term, since their loss and gradient are exactly 0).
2. ``_forward_backward``: zero the gradients, then phase 3 for each micro-batch of
   ``trainer.micro_batch_size`` rows.
3. ``_micro_batch``: log π_θ (prefix-shared forward, :func:`trainer_service.forward.completion_logprobs`) →
   the loss's surrogate against the behaviour log-probs (``trainer.loss``, resolved once by
   ``losses.resolve_loss``) → KL to the reference (optional; importance-weighted to the behaviour policy
   under staleness) → backward (gradients accumulate).
4. ``_optimizer_step``: clip → AdamW step → LR schedule → version + 1.
5. ``_metrics``: the summed statistics as per-token means, and the batch's counters.
"""

from __future__ import annotations

import copy
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from shared import lora
from shared.checkpoint import read_update
from shared.config import BudgetConfig
from shared.model_weights import live_weights, load_weights, snapshot_weights
from shared.schemas import AdapterInfo, ScoredTrajectory, WeightUpdate
from trainer_service.config import TrainerConfig, resolve_precision
from trainer_service.forward import Batch, collate, completion_logprobs
from trainer_service.groups import Group
from trainer_service.losses import resolve_loss
from trainer_service.losses.grpo import aggregate
from trainer_service.losses.kl import kl_importance_weight, kl_term, kl_value
from trainer_service.losses.mismatch import METRICS as MISMATCH_METRICS
from trainer_service.losses.mismatch import mismatch_sums, onpolicy_means
from trainer_service.losses.output import LossOutput, TokenMean, token_means


def lr_factor(cfg: TrainerConfig, max_steps: int, step: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based; the step about to be taken).

    Linear warm-up over ``lr_warmup_steps`` ((step + 1) / warm-up), then constant or a cosine from 1 to
    ``lr_min_ratio`` reached at ``max_steps - 1`` (``budget.max_steps``): r + (1 − r) · (1 + cos(π · t)) / 2 with t the
    fraction of the post-warm-up steps done.
    """
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(1, max_steps - 1 - warmup)
    t = min(1.0, (step - warmup) / span)
    return cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass
class StepPlan:
    """The rows of one optimizer step and their advantages, after the truncation policy (phase 1).

    ``all_rows``: the N rows of the step's groups, in group order; ``all_adv``: ``[N]`` float32, their
    advantages; ``zero_var``: groups whose advantages are all exactly 0. ``rows``: the R ≤ N rows that
    train (``truncation: mask`` leaves out rows cut at the token budget), sorted by prompt and length so
    that a group's rows share a micro-batch; ``advantages``: ``[R]`` float32. ``n_tokens``: unmasked
    tokens of the R rows (≥ 1). ``normalizer``: the loss denominator of the R rows
    (``grpo.batch_normalizer``, ≥ 1). ``live_rows``, ``live_adv`` ``[L]`` float32: the L ≤ R rows that go
    through the model (without a KL term, a row whose advantage is exactly 0 has loss and gradient
    exactly 0 and is skipped); ``live_tokens``: their unmasked tokens (≥ 1).
    """

    all_rows: list[ScoredTrajectory]
    all_adv: torch.Tensor
    zero_var: int
    rows: list[ScoredTrajectory]
    advantages: torch.Tensor
    n_tokens: float
    normalizer: float
    live_rows: list[ScoredTrajectory]
    live_adv: torch.Tensor
    live_tokens: float


@dataclass
class StepSums:
    """What the micro-batches of one step add up (phase 3), before it becomes metrics (phase 5).

    ``pg``, ``kl_ref``: sums of the micro-batches' surrogate losses and β-free KL terms (each a share of
    the batch loss, so the sums are the batch's). ``tokens``: the surrogate's ``_sum`` statistics plus
    ``loss/entropy_sum`` (nats), whatever keys the loss returned; ``kl_tokens``: ``loss/kl_ref_sum`` and
    ``loss/kl_ref_weight_sum``. All sums over unmasked tokens, plain floats.
    """

    pg: float = 0.0
    kl_ref: float = 0.0
    tokens: dict[str, float] = field(default_factory=dict)
    kl_tokens: dict[str, float] = field(default_factory=dict)
    mismatch: dict[str, float] = field(default_factory=dict)
    """``losses/mismatch.py``'s sums: |Δlogp| and k3 against the behaviour log-probs, over all tokens and over
    the tokens of samples the trainer's current version generated."""


ENTROPY_METRICS = {"loss/entropy_sum": TokenMean("loss/entropy")}
"""The trainer's own per-token statistic: the entropy of the policy at each trained token (nats)."""
KL_METRICS = {"loss/kl_ref_sum": TokenMean("loss/kl_ref_mean"),
              "loss/kl_ref_weight_sum": TokenMean("loss/kl_ref_weight_mean", empty=1.0)}
"""The KL term's per-token statistics: the importance-weighted estimate of KL(π_θ ‖ π_ref) and the mean
weight π_θ/π_behaviour (``losses/kl.py``)."""


def reference_model(model: torch.nn.Module, bf16: bool = False, bf16_head: bool = False) -> torch.nn.Module:
    """A frozen copy of ``model`` (the base policy of the KL term), in eval mode.

    With ``bf16`` the copy's weights are bf16 (half the memory, no per-forward cast under autocast). Its output
    layer stays a float32 copy (untied from the bf16 input embedding when the two were tied) unless
    ``bf16_head`` (``trainer.output_bf16``: the policy's output layer computes in bf16 too), so that reference
    log-probs are computed as :func:`trainer_service.forward.completion_logprobs` computes them for the
    policy.
    """
    ref = copy.deepcopy(model).eval()
    if bf16:
        head = None if bf16_head else ref.lm_head.weight.detach().clone().float()
        ref.to(torch.bfloat16)
        if head is not None:
            ref.lm_head.weight = torch.nn.Parameter(head)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes ``params`` (floating point, on a CPU or CUDA device)."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _add(sums: dict[str, float], metrics: dict[str, float]) -> None:
    """Add each of ``metrics`` to ``sums`` (a missing key starts at 0)."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v


class PolicyTrainer:
    """Model + AdamW + LR schedule + the counters that define the policy version.

    ``version`` is the number of optimizer steps published so far (0 = the base model). With
    ``cfg.kl_coef > 0`` a frozen copy of the model as given (the base policy) is the KL reference.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, pad_id: int,
                 max_steps: int = BudgetConfig().max_steps) -> None:
        self.model = model
        self.canary = None
        """The service's :class:`trainer_service.canary.CanaryCheck` (set by ``build_trainer``; None in tests)."""
        cfg, self.precision = resolve_precision(cfg, next(model.parameters()).device.type)
        self.cfg = cfg
        self.pad_id = pad_id
        self.loss = resolve_loss(cfg.loss)
        self.ref_model: torch.nn.Module | None = None
        if cfg.kl_coef > 0:  # before the adapters: the reference is the base policy
            self.ref_model = reference_model(model, bf16=cfg.autocast_bf16, bf16_head=cfg.output_bf16)
        self.adapter: AdapterInfo | None = None
        """With ``cfg.lora``: the LoRA adapters trained (the only parameters with gradients) and published."""
        if cfg.lora is not None:
            self.adapter = lora.inject(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules, cfg.lora.dropout)
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel per parameter instead of ~10 elementwise passes; 0.11 s instead of 0.48 s a step for
        # SmolLM2 on one CPU thread, equal to the loop implementation within float rounding
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay, fused=_fused_ok(params))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, cfg, max_steps))
        self.step = 0
        self.version = 0
        self.optimizer_restored = True
        """False after :meth:`load_state_dict` of a state whose optimizer moments were dropped."""
        self.update_gate = threading.Event()
        """Set while the weights and optimizer state may change. The service clears it when it hands the live
        tensors of a version to its writer (:meth:`state_dict` with ``copy_optimizer=False``,
        :func:`shared.model_weights.live_weights`) and sets it once they are on disk; the next
        :meth:`_optimizer_step` waits for it, so a checkpoint never mixes two versions and nothing is copied."""
        self.update_gate.set()
        self.gate_wait_s = 0.0
        """Seconds the last :meth:`_optimizer_step` waited for :attr:`update_gate` (the previous version's files)."""

    # ------------------------------------------------------------------ one step
    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on complete groups; returns metrics (names prefixed by area: ``loss/``,
        ``train/``, ``time/``; per-token statistics are means over the tokens that went through the model).

        Phases: :meth:`_plan` (truncation policy, advantages, row order, normaliser, rows to skip) →
        :meth:`_forward_backward` (per micro-batch: :meth:`_micro_batch`) → :meth:`_optimizer_step`
        (clip, AdamW, LR schedule, version) → :meth:`_metrics`.

        Raises:
            ValueError: ``groups`` is empty.
        """
        if not groups:
            raise ValueError("train_step needs at least one group")
        t0 = time.perf_counter()
        plan = self._plan(groups)
        sums = self._forward_backward(plan)
        grad_norm, lr = self._optimizer_step()
        return self._metrics(len(groups), plan, sums, grad_norm, lr, time.perf_counter() - t0)

    def _plan(self, groups: list[Group]) -> StepPlan:
        """Phase 1: rows, advantages (:meth:`_advantages`), the rows that train and those that go through the model.

        The result does not depend on the micro-batch split: the normaliser counts every training row
        (skipped ones included), and the sort only puts a group's rows (one prompt pass) and similar
        lengths (less padding) together.
        """
        all_rows, all_adv, zero_var, trains = self._advantages(groups)
        # truncation "mask": those rows count in their group's advantages but train nothing
        rows = [r for r, t in zip(all_rows, trains) if t]
        advantages = all_adv[torch.tensor(trains, dtype=torch.bool)]
        order = sorted(range(len(rows)), key=lambda i: (len(rows[i].trajectory.prompt_ids),
                                                        rows[i].trajectory.prompt_ids,
                                                        len(rows[i].trajectory.completion_ids)))
        rows, advantages = [rows[i] for i in order], advantages[order]
        tokens = [sum(r.trajectory.loss_mask) for r in rows]
        normalizer = self.loss.normalizer([r.trajectory.loss_mask for r in rows])
        live = [i for i in range(len(rows)) if advantages[i] != 0 or self.ref_model is not None]
        return StepPlan(all_rows, all_adv, zero_var, rows, advantages, max(1.0, float(sum(tokens))), normalizer,
                        [rows[i] for i in live], advantages[live], max(1.0, float(sum(tokens[i] for i in live))))

    def _forward_backward(self, plan: StepPlan) -> StepSums:
        """Phase 2: zero the gradients and accumulate those of every live micro-batch of
        ``cfg.micro_batch_size`` rows (:meth:`_micro_batch`); returns the step's sums."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = StepSums()
        mb = self.cfg.micro_batch_size
        for i in range(0, len(plan.live_rows), mb):
            self._micro_batch(plan.live_rows[i:i + mb], plan.live_adv[i:i + mb], plan.normalizer, sums)
        return sums

    def _micro_batch(self, rows: list[ScoredTrajectory], advantages: torch.Tensor, normalizer: float,
                     sums: StepSums) -> None:
        """Phase 3, one micro-batch of B rows: forward, loss, backward (gradients accumulate), adding to ``sums``.

        Args:
            rows: the B rows (collated to ``[B, T]``; log π_θ is ``[B, T]`` float32, float64 for a float64 model).
            advantages: ``[B]`` float32.
            normalizer: the whole batch's loss denominator (:attr:`StepPlan.normalizer`).
            sums: the step's sums so far (updated in place).
        """
        batch = collate(rows, self.pad_id)
        ent: list[torch.Tensor] = []
        logprobs = completion_logprobs(self.model, batch, self.cfg.autocast_bf16, entropy=ent,  # [B, T], grad
                                       output_bf16=self.cfg.output_bf16)
        out = self.loss.surrogate(logprobs, batch.behaviour_logprobs, advantages, batch.loss_mask, normalizer,
                                  self.loss.cfg)
        sums.pg += float(out.loss.detach())
        loss = out.loss
        if self.ref_model is not None:
            kl = self._kl_to_reference(logprobs, batch, normalizer)
            sums.kl_ref += float(kl.loss.detach())
            _add(sums.kl_tokens, kl.metrics)
            loss = loss + self.cfg.kl_coef * kl.loss
        loss.backward()
        onpolicy = torch.tensor([all(s.version == self.version for s in r.trajectory.policy_versions)
                                 for r in rows], dtype=torch.bool)
        _add(sums.mismatch, mismatch_sums(logprobs, batch.behaviour_logprobs, batch.loss_mask, onpolicy))
        _add(sums.tokens, {"loss/entropy_sum": float((ent[0] * batch.loss_mask).sum())})
        _add(sums.tokens, out.metrics)

    def _optimizer_step(self) -> tuple[float, float]:
        """Phase 4: clip the global gradient norm, step AdamW and the LR schedule, count the new version.
        AdamW waits for :attr:`update_gate` first (open unless the previous version is still being written).

        Returns:
            ``(grad_norm, lr)``: the L2 norm of the gradient before clipping and the learning rate of this step.
        """
        for p in self.model.parameters():  # AdamW skips a None grad; a zero one still moves the moments
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        self.update_gate.wait()  # the previous version's weights and moments are being written from these tensors
        self.gate_wait_s = time.perf_counter() - t0
        self.optimizer.step()
        self.lr_scheduler.step()
        self.model.eval()
        self.step += 1
        self.version += 1
        return float(grad_norm), float(lr)

    def _metrics(self, n_groups: int, plan: StepPlan, sums: StepSums, grad_norm: float, lr: float,
                 elapsed: float) -> dict[str, float]:
        """Phase 5: the step's metrics: ``loss/pg``, the per-token means of ``sums`` over the live tokens
        (the loss's :attr:`LossSpec.metrics`, then ``loss/entropy``), ``train/*``, ``time/train_step_s``
        (seconds), the staleness histogram and, with a KL term, ``loss/kl_ref`` and its per-token means."""
        rows = plan.all_rows
        rewards = [r.reward.total for r in rows]
        staleness = [self.version - 1 - r.trajectory.behaviour_version for r in rows]
        any_live = bool(plan.live_rows)
        metrics = {
            "loss/pg": sums.pg,
            **token_means(sums.tokens, {**self.loss.metrics, **ENTROPY_METRICS}, plan.live_tokens, any_live),
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/reward_mean": float(np.mean(rewards)),
            "train/pass_rate": float(np.mean([x >= 1.0 for x in rewards])),
            "train/adv_mean": float(plan.all_adv.mean()),
            "train/adv_std": float(plan.all_adv.std()) if len(plan.all_adv) > 1 else 0.0,
            "train/response_len": float(np.mean([len(r.trajectory.completion_ids) for r in rows])),
            "train/truncated_frac": float(np.mean([r.trajectory.finish_reason == "length" for r in rows])),
            "train/truncated_masked": float(len(rows) - len(plan.rows)),
            "train/staleness_mean": float(np.mean(staleness)),
            "train/staleness_max": float(max(staleness)),
            "train/zero_variance_groups": float(plan.zero_var),
            "train/skipped_zero_adv_samples": float(len(plan.rows) - len(plan.live_rows)),
            "train/groups": float(n_groups),
            "train/samples": float(len(rows)),
            "train/tokens": plan.n_tokens,
            "train/tokens_per_s": plan.n_tokens / elapsed,
            "time/train_step_s": elapsed,
        }
        metrics.update(token_means({k: v for k, v in sums.mismatch.items() if k in MISMATCH_METRICS},
                                   MISMATCH_METRICS, plan.live_tokens, any_live))
        metrics.update(onpolicy_means(sums.mismatch))
        for s_, n in sorted(Counter(staleness).items()):
            metrics[f"train/staleness_hist/{s_}"] = float(n)
        if self.ref_model is not None:
            metrics["loss/kl_ref"] = sums.kl_ref
            metrics.update(token_means(sums.kl_tokens, KL_METRICS, plan.live_tokens, any_live))
        return metrics

    def _kl_to_reference(self, logprobs: torch.Tensor, batch: Batch, normalizer: float) -> LossOutput:
        """The KL term of one micro-batch: a scalar aggregated like the surrogate (β not applied), and the
        sums ``loss/kl_ref_sum`` (the weighted estimate of KL(π_θ ‖ π_ref), nats) and ``loss/kl_ref_weight_sum``.

        ``logprobs``: ``[B, T]`` float, log π_θ (requires grad). Its samples come from the behaviour policy,
        so every token is weighted by π_θ/π_behaviour (1 on-policy; ``losses/kl.py``).
        """
        with torch.no_grad():
            ref = completion_logprobs(self.ref_model, batch, self.cfg.autocast_bf16, output_bf16=self.cfg.output_bf16)
        mask = batch.loss_mask
        weight = kl_importance_weight(logprobs, batch.behaviour_logprobs, mask)
        kl = aggregate(kl_term(logprobs, ref, self.cfg.kl_estimator, weight), mask, normalizer,
                       self.loss.cfg.loss_agg)
        value = kl_value(logprobs.detach(), ref, self.cfg.kl_estimator)
        return LossOutput(kl, {"loss/kl_ref_sum": float((weight * value * mask).sum()),
                               "loss/kl_ref_weight_sum": float((weight * mask).sum())})

    def _advantages(self, groups: list[Group]) -> tuple[list[ScoredTrajectory], torch.Tensor, int, list[bool]]:
        """Rows, their advantages ``[N]`` float32 (computed per group in float64 after the truncation
        penalty), the count of zero-variance groups, and whether each row trains (``truncation``)."""
        rows: list[ScoredTrajectory] = []
        advs: list[torch.Tensor] = []
        trains: list[bool] = []
        zero_var = 0
        policy = self.cfg.truncation
        for g in groups:
            grow = g.rows()
            cut = [s.trajectory.finish_reason == "length" for s in grow]
            rewards = [s.reward.total - (self.cfg.truncation_penalty if c and policy == "penalise" else 0.0)
                       for s, c in zip(grow, cut)]
            a = self.loss.advantages(torch.tensor([rewards], dtype=torch.float64))[0]
            zero_var += int(bool((a == 0).all()))
            rows.extend(grow)
            advs.append(a)
            trains.extend(not (c and policy == "mask") for c in cut)
        return rows, torch.cat(advs).float(), zero_var, trains

    # ------------------------------------------------------------------ state
    def published_weights(self, live: bool = True) -> dict[str, torch.Tensor]:
        """What a policy version publishes: the full weights (:func:`shared.model_weights.live_weights`, or
        :func:`~shared.model_weights.snapshot_weights` copies without ``live``), or with LoRA only the adapters
        (:func:`shared.lora.adapter_state`).

        Raises:
            ValueError: ``live`` and the weights are not contiguous CPU tensors (take copies instead).
        """
        if self.adapter is not None:
            state = lora.adapter_state(self.model, self.adapter, copy=not live)
            if live and any(t.device.type != "cpu" or not t.is_contiguous() for t in state.values()):
                raise ValueError("live adapters need contiguous CPU tensors")
            return state
        return live_weights(self.model) if live else snapshot_weights(self.model)

    def load_published(self, update: WeightUpdate, verify: bool = True) -> None:
        """Load a published version's weights into the model (a resume): full weights, or the adapters.

        Raises:
            ValueError: the version and the trainer disagree on LoRA (a run directory trained with the other
                setting), the adapter does not fit, or the file's checksum differs from the record's.
            FileNotFoundError: the version's file is gone.
        """
        if (update.adapter is None) != (self.adapter is None):
            have = "LoRA adapters" if update.adapter else "full weights"
            raise ValueError(f"policy version {update.version} holds {have}, and trainer.lora is "
                             f"{'set' if self.adapter else 'not set'}: resume with the setting the run was trained with")
        if self.adapter is None:
            load_weights(self.model, update, verify)
            return
        if update.adapter != self.adapter:
            raise ValueError(f"policy version {update.version}'s adapters ({update.adapter}) differ from "
                             f"trainer.lora's ({self.adapter})")
        lora.load_adapter_state(self.model, read_update(update, verify), self.adapter, f"v{update.version}")

    def state_dict(self, done_groups: set[str], copy_optimizer: bool = True) -> dict:
        """Everything except the weights needed to resume exactly (optimizer, RNG, counters, ids).

        ``copy_optimizer``: a deep copy of the optimizer state (later optimizer steps do not change it, so it
        can be written in the background; ~1.1 GB for SmolLM2). ``False``: the live moment tensors, for a
        writer that holds :attr:`update_gate` clear until it is done (what the service does).
        """
        optimizer = self.optimizer.state_dict()
        return {
            "optimizer": copy.deepcopy(optimizer) if copy_optimizer else optimizer,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "step": self.step,
            "version": self.version,
            "done_groups": sorted(done_groups),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> set[str]:
        """Restore from :meth:`state_dict`; returns the ids of groups already trained or dropped.

        ``state["optimizer"]`` may be ``None`` (dropped at the end of a finished run: the checkpoint store's
        ``drop_optimizer_on_finish``, or ``flywheel clean``): the optimizer then keeps its fresh state, and
        :attr:`optimizer_restored` is False so that the caller can refuse to train on from it.
        """
        self.optimizer_restored = state.get("optimizer") is not None
        if self.optimizer_restored:
            self.optimizer.load_state_dict(state["optimizer"])
            for group in self.optimizer.param_groups:  # the saved groups carry the saver's kernel choice
                group["fused"] = _fused_ok(group["params"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step, self.version = state["step"], state["version"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        return set(state["done_groups"])
