"""The policy trainer: one optimizer step of a GRPO-family loss over complete groups.

A step reads top to bottom in named phases: truncation policy → advantages (``losses/advantages.py``)
→ micro-batched forward and backward (gradients accumulate, normalised by the whole batch's token or
sequence count; rows whose advantage is exactly 0 are skipped when there is no KL term, since their
loss and gradient are exactly 0) → KL to the reference (optional; importance-weighted to the behaviour
policy under staleness) → clip → AdamW step → LR schedule.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from shared.config import BudgetConfig
from shared.schemas import ScoredTrajectory
from trainer_service.config import TrainerConfig
from trainer_service.groups import Group
from trainer_service.losses import resolve_loss
from trainer_service.losses.advantages import group_advantages
from trainer_service.losses.grpo import aggregate, batch_normalizer
from trainer_service.losses.kl import kl_importance_weight, kl_term, kl_value


@dataclass
class Batch:
    """Padded tensors of a list of trajectories, each distinct prompt stored once.

    The K samples of a group share their prompt: it is encoded once and its key/value cache is
    expanded to the rows (prefix sharing), which gives the same log-probs and gradients as encoding
    every row in full at a fraction of the cost.

    ``prompt_ids``, ``prompt_mask``: ``[U, P]`` long, the U distinct prompts left-padded to P.
    ``prompt_lengths``: ``[U]`` long. ``row_prompt``: ``[B]`` long, the prompt of each row.
    ``completion_ids``, ``completion_mask``: ``[B, T]`` long, right-padded completions and their
    attention mask. ``behaviour_logprobs``, ``loss_mask``: ``[B, T]`` float. ``temperature``: ``[B]``
    float, the sampling temperature of each row (its logits are divided by it).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    row_prompt: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    loss_mask: torch.Tensor
    temperature: torch.Tensor


def collate(rows: list[ScoredTrajectory], pad_id: int, dtype: torch.dtype = torch.float32) -> Batch:
    """Pad ``rows`` into a :class:`Batch`."""
    prompts: dict[tuple[int, ...], int] = {}
    row_prompt = [prompts.setdefault(tuple(r.trajectory.prompt_ids), len(prompts)) for r in rows]
    P = max(len(p) for p in prompts)
    T = max(1, max(len(r.trajectory.completion_ids) for r in rows))
    B, U = len(rows), len(prompts)
    pids = torch.full((U, P), pad_id, dtype=torch.long)
    pmask = torch.zeros((U, P), dtype=torch.long)
    for p, u in prompts.items():
        pids[u, P - len(p):] = torch.tensor(p)
        pmask[u, P - len(p):] = 1
    comp = torch.full((B, T), pad_id, dtype=torch.long)
    cmask = torch.zeros((B, T), dtype=torch.long)
    blp = torch.zeros((B, T), dtype=dtype)
    mask = torch.zeros((B, T), dtype=dtype)
    for i, r in enumerate(rows):
        tr = r.trajectory
        c = len(tr.completion_ids)
        if c:
            comp[i, :c] = torch.tensor(tr.completion_ids)
            cmask[i, :c] = 1
            blp[i, :c] = torch.tensor(tr.completion_logprobs, dtype=dtype)
            mask[i, :c] = torch.tensor(tr.loss_mask, dtype=dtype)
    # greedy rows (temperature 0, evaluation) never train; score them at 1 rather than divide by 0
    temp = torch.tensor([r.trajectory.temperature or 1.0 for r in rows], dtype=dtype)
    return Batch(pids, pmask, pmask.sum(1), torch.tensor(row_prompt), comp, cmask, blp, mask, temp)


def completion_logprobs(model: torch.nn.Module, batch: Batch, autocast_bf16: bool = False,
                        entropy: list | None = None) -> torch.Tensor:
    """log π_θ of each completion token at the row's sampling temperature: ``[B, T]``, float32
    (float64 for a float64 model). With ``entropy`` (a list), the ``[B, T]`` entropy of each token's
    distribution (nats, no gradient) is appended to it.

    Two passes of the transformer body: the U distinct prompts (with their key/value cache, which
    keeps its autograd graph), then the B completions on top of the cache expanded to the rows.
    Only completion positions go through the output layer. With ``autocast_bf16`` the body runs in
    bf16; the output layer and log-softmax in float32.
    """
    body = model.model
    device_type = batch.prompt_ids.device.type
    T = batch.completion_ids.shape[1]
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast_bf16):
        ppos = (batch.prompt_mask.cumsum(1) - 1).clamp(min=0)
        pout = body(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, position_ids=ppos, use_cache=True)
        cache = pout.cache
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, batch.row_prompt)
            layer.values = layer.values.index_select(0, batch.row_prompt)
        cpos = batch.prompt_lengths[batch.row_prompt].unsqueeze(1) + torch.arange(T).unsqueeze(0)
        attn = torch.cat([batch.prompt_mask.index_select(0, batch.row_prompt), batch.completion_mask], dim=1)
        cout = body(input_ids=batch.completion_ids, attention_mask=attn, position_ids=cpos, cache=cache,
                    use_cache=True)
    # token t is predicted from the hidden state before it: the prompt's last one, then completion 0..T-2
    first = pout.last_hidden_state[:, -1:].index_select(0, batch.row_prompt)
    hidden = torch.cat([first, cout.last_hidden_state[:, :-1]], dim=1)
    w = model.lm_head.weight
    logits = torch.nn.functional.linear(hidden.to(w.dtype), w)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits / batch.temperature.to(logits.dtype)[:, None, None]  # what the rollout sampled from
    logp = torch.log_softmax(logits, dim=-1)
    if entropy is not None:
        with torch.no_grad():
            entropy.append(-(logp.exp() * logp).sum(-1))
    return logp.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


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


class PolicyTrainer:
    """Model + AdamW + LR schedule + the counters that define the policy version.

    ``version`` is the number of optimizer steps published so far (0 = the base model). With
    ``cfg.kl_coef > 0`` a frozen copy of the model as given (the base policy) is the KL reference.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, pad_id: int,
                 max_steps: int = BudgetConfig().max_steps) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.loss = resolve_loss(cfg)
        self.loss_cfg = self.loss.cfg
        self.ref_model: torch.nn.Module | None = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, cfg, max_steps))
        self.step = 0
        self.version = 0

    # ------------------------------------------------------------------ one step
    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on complete groups; returns metrics (names prefixed by area).

        Raises:
            ValueError: ``groups`` is empty.
        """
        if not groups:
            raise ValueError("train_step needs at least one group")
        t0 = time.perf_counter()
        all_rows, all_adv, zero_var, trains = self._advantages(groups)
        # truncation "mask": those rows count in their group's advantages but train nothing
        rows = [r for r, t in zip(all_rows, trains) if t]
        advantages = all_adv[torch.tensor(trains, dtype=torch.bool)]
        # a group's rows share a micro-batch (one prompt pass), similar lengths together (less padding);
        # the result does not depend on the split
        order = sorted(range(len(rows)), key=lambda i: (len(rows[i].trajectory.prompt_ids),
                                                        rows[i].trajectory.prompt_ids,
                                                        len(rows[i].trajectory.completion_ids)))
        rows, advantages = [rows[i] for i in order], advantages[order]
        tokens = [sum(r.trajectory.loss_mask) for r in rows]
        n_tokens = max(1.0, float(sum(tokens)))
        # the denominator counts every training row, including those skipped below
        normalizer = batch_normalizer([r.trajectory.loss_mask for r in rows], self.loss_cfg)
        # without a KL term, a row with advantage exactly 0 (its group's rewards are all equal) has loss
        # and gradient exactly 0: skip its forward and backward, the step is the same
        live = [i for i in range(len(rows)) if advantages[i] != 0 or self.ref_model is not None]
        live_rows, live_adv = [rows[i] for i in live], advantages[live]
        live_tokens = max(1.0, float(sum(tokens[i] for i in live)))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss/pg": 0.0, "loss/kl_ref": 0.0, "loss/clip_frac_sum": 0.0,
                                  "loss/kl_behaviour_sum": 0.0, "loss/ratio_sum": 0.0, "loss/is_weight_sum": 0.0,
                                  "loss/is_truncated_sum": 0.0, "loss/entropy_sum": 0.0, "loss/kl_ref_sum": 0.0,
                                  "loss/kl_ref_weight_sum": 0.0}
        mb = self.cfg.micro_batch_size
        for i in range(0, len(live_rows), mb):
            batch = collate(live_rows[i:i + mb], self.pad_id)
            ent: list[torch.Tensor] = []
            logprobs = completion_logprobs(self.model, batch, self.cfg.autocast_bf16, entropy=ent)
            loss, m = self.loss.surrogate(logprobs, batch.behaviour_logprobs, live_adv[i:i + mb], batch.loss_mask,
                                          normalizer, self.loss_cfg)
            sums["loss/pg"] += float(loss.detach())
            mask = batch.loss_mask
            if self.ref_model is not None:
                loss = loss + self.cfg.kl_coef * self._kl_to_reference(logprobs, batch, normalizer, sums)
            loss.backward()
            sums["loss/entropy_sum"] += float((ent[0] * mask).sum())
            for k, v in m.items():
                sums[k] += v
        for p in self.model.parameters():  # AdamW skips a None grad; a zero one still moves the moments
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.model.eval()
        self.step += 1
        self.version += 1
        rewards = [r.reward.total for r in all_rows]
        lengths = [len(r.trajectory.completion_ids) for r in all_rows]
        staleness = [self.version - 1 - r.trajectory.behaviour_version for r in all_rows]
        elapsed = time.perf_counter() - t0
        metrics = {
            "loss/pg": sums["loss/pg"],
            # per-token statistics over the tokens that went through the model
            "loss/clip_frac": sums["loss/clip_frac_sum"] / live_tokens,
            "loss/kl_behaviour": sums["loss/kl_behaviour_sum"] / live_tokens,
            "loss/ratio_mean": sums["loss/ratio_sum"] / live_tokens if live_rows else 1.0,
            "loss/is_weight_mean": sums["loss/is_weight_sum"] / live_tokens if live_rows else 1.0,
            "loss/is_truncated_frac": sums["loss/is_truncated_sum"] / live_tokens,
            "loss/entropy": sums["loss/entropy_sum"] / live_tokens,
            "train/grad_norm": float(grad_norm),
            "train/lr": float(lr),
            "train/reward_mean": float(np.mean(rewards)),
            "train/pass_rate": float(np.mean([x >= 1.0 for x in rewards])),
            "train/adv_mean": float(all_adv.mean()),
            "train/adv_std": float(all_adv.std()) if len(all_adv) > 1 else 0.0,
            "train/response_len": float(np.mean(lengths)),
            "train/truncated_frac": float(np.mean([r.trajectory.finish_reason == "length" for r in all_rows])),
            "train/truncated_masked": float(len(all_rows) - len(rows)),
            "train/staleness_mean": float(np.mean(staleness)),
            "train/staleness_max": float(max(staleness)),
            "train/zero_variance_groups": float(zero_var),
            "train/skipped_zero_adv_samples": float(len(rows) - len(live_rows)),
            "train/groups": float(len(groups)),
            "train/samples": float(len(all_rows)),
            "train/tokens": n_tokens,
            "train/tokens_per_s": n_tokens / elapsed,
            "time/train_step_s": elapsed,
        }
        for s_, n in sorted(Counter(staleness).items()):
            metrics[f"train/staleness_hist/{s_}"] = float(n)
        if self.ref_model is not None:
            metrics["loss/kl_ref"] = sums["loss/kl_ref"]
            metrics["loss/kl_ref_mean"] = sums["loss/kl_ref_sum"] / live_tokens
            metrics["loss/kl_ref_weight_mean"] = sums["loss/kl_ref_weight_sum"] / live_tokens if live_rows else 1.0
        return metrics

    def _kl_to_reference(self, logprobs: torch.Tensor, batch: Batch, normalizer: float,
                         sums: dict[str, float]) -> torch.Tensor:
        """The KL term of one micro-batch (scalar, aggregated like the surrogate), adding its metrics to ``sums``.

        Its samples come from the behaviour policy, so every token is weighted by π_θ/π_behaviour (1
        on-policy; ``losses/kl.py``); ``loss/kl_ref_sum`` is the weighted estimate of KL(π_θ ‖ π_ref).
        """
        with torch.no_grad():
            ref = completion_logprobs(self.ref_model, batch, self.cfg.autocast_bf16)
        mask = batch.loss_mask
        weight = kl_importance_weight(logprobs, batch.behaviour_logprobs, mask)
        kl = aggregate(kl_term(logprobs, ref, self.cfg.kl_estimator, weight), mask, normalizer, self.loss_cfg.loss_agg)
        sums["loss/kl_ref"] += float(kl.detach())
        value = kl_value(logprobs.detach(), ref, self.cfg.kl_estimator)
        sums["loss/kl_ref_sum"] += float((weight * value * mask).sum())
        sums["loss/kl_ref_weight_sum"] += float((weight * mask).sum())
        return kl

    def _advantages(self, groups: list[Group]) -> tuple[list[ScoredTrajectory], torch.Tensor, int, list[bool]]:
        """Rows, their advantages ``[N]`` float32, the count of zero-variance groups, and whether each row trains."""
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
            a = group_advantages(torch.tensor([rewards], dtype=torch.float64), self.loss.estimator, self.cfg.adv_eps)[0]
            zero_var += int(bool((a == 0).all()))
            rows.extend(grow)
            advs.append(a)
            trains.extend(not (c and policy == "mask") for c in cut)
        return rows, torch.cat(advs).float(), zero_var, trains

    # ------------------------------------------------------------------ state
    def state_dict(self, done_groups: set[str]) -> dict:
        """Everything except the weights needed to resume exactly (optimizer, RNG, counters, ids).

        A deep copy: later optimizer steps do not change it, so it can be written in the background.
        """
        return {
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "step": self.step,
            "version": self.version,
            "done_groups": sorted(done_groups),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> set[str]:
        """Restore from :meth:`state_dict`; returns the ids of groups already trained or dropped."""
        self.optimizer.load_state_dict(state["optimizer"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step, self.version = state["step"], state["version"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        return set(state["done_groups"])
