"""The policy's forward pass over a batch of trajectories: padding rows into a :class:`Batch` (each distinct
prompt once) and the log-probability of every completion token (:func:`completion_logprobs`), with the
completions split into passes of similar length (:func:`length_buckets`).

The trainer (``trainer_service.trainer``) scores the policy and the KL reference with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.schemas import ScoredTrajectory
from trainer_service.token_logprobs import token_logprobs


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
    """Pad ``rows`` into a :class:`Batch` (``dtype``: of its log-probs, loss mask and temperatures)."""
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


PASS_COST_TOKENS = 12.0
"""What one more completion pass of the body costs, in tokens of one row (:func:`length_buckets`): the fixed cost of
a pass of the layers (kernel launches, masks, the cache copy) against one row-token's matmuls. An estimate, not
fitted: with it a main-job SmolLM2 step (bf16, KL, one thread) on a batch of short answers (273 tokens, 2-24 a
row) took 4.0 s against 5.7 s in one padded pass, and on the base model's batch (696 tokens, mostly 24 a row)
6.3-6.5 s against 6.3-7.0 s."""


def length_buckets(lengths: list[int], pass_cost: float = PASS_COST_TOKENS) -> list[list[int]]:
    """Split rows into completion passes by length: the rows (indices into ``lengths``) of each pass.

    A pass over rows of lengths ≤ L feeds each of them L − 1 tokens (the first completion token is predicted
    from the prompt's last hidden state), padding included. The split minimises Σ rows × (L − 1) plus
    ``pass_cost`` per pass that feeds any token, by dynamic programming over the rows sorted by length
    (O(n²), n rows). With ``pass_cost`` = ∞ it is one pass (plain padding to the longest); with 0, one pass per
    distinct length (no padding at all). Rows of length 0 or 1 need no pass and share the first bucket.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    if n == 0:
        return []
    ls = [max(0, lengths[i] - 1) for i in order]  # tokens fed per row, sorted
    best = [0.0] + [math.inf] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        L = ls[j - 1]
        for i in range(j):  # rows i..j-1 in one pass (padded to ls[j-1])
            c = best[i] + (j - i) * L + (pass_cost if L > 0 else 0.0)
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j]:j])
        j = cut[j]
    return out[::-1]


def completion_logprobs(model: torch.nn.Module, batch: Batch, autocast_bf16: bool = False,
                        entropy: list | None = None, output_bf16: bool = False,
                        pass_cost: float = PASS_COST_TOKENS) -> torch.Tensor:
    """log π_θ of each completion token at the row's sampling temperature: ``[B, T]``, float32
    (float64 for a float64 model), 0 at padding. With ``entropy`` (a list), the ``[B, T]`` entropy of each
    token's distribution (nats, no gradient, 0 at padding) is appended to it.

    Passes of the transformer body: the U distinct prompts (with their key/value cache, which keeps its
    autograd graph), then the completions on top of the cache expanded to their rows, in passes of rows of
    similar length (:func:`length_buckets` with ``pass_cost``) so that short completions are not padded to the
    longest: each row's log-probs are those of one full forward of prompt + completion whatever the split.
    Only the completion tokens (not the padding) go through the output layer, fused with the log-softmax in
    chunks (:func:`trainer_service.token_logprobs.token_logprobs`). With ``autocast_bf16`` the body runs in
    bf16; with ``output_bf16`` the output layer's matmuls too (log-sum-exp and log-probs stay float32).
    """
    from transformers import DynamicCache

    body = model.model
    device_type = batch.prompt_ids.device.type
    live = batch.completion_mask.bool()  # [B, T]
    lengths = batch.completion_mask.sum(1)  # [B]
    flat = torch.full(live.shape, -1, dtype=torch.long)
    flat[live] = torch.arange(int(live.sum()))  # each live token's place in the row-major order of live
    pieces, places = [], []
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast_bf16):
        ppos = (batch.prompt_mask.cumsum(1) - 1).clamp(min=0)
        pout = body(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, position_ids=ppos, use_cache=True)
        # token t is predicted from the hidden state before it: the prompt's last one, then completion 0..L-2
        last = pout.last_hidden_state[:, -1:]  # [U, 1, H]
        for rows in length_buckets(lengths.tolist(), pass_cost):
            idx = torch.tensor(rows)
            L = int(lengths[idx].max())
            if L == 0:
                continue
            rp = batch.row_prompt[idx]
            hidden = last.index_select(0, rp)  # [b, 1, H]
            if L > 1:
                cache = DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, rp), layer.values.index_select(0, rp))
                                                     for layer in pout.cache.layers])
                cpos = batch.prompt_lengths[rp].unsqueeze(1) + torch.arange(L - 1).unsqueeze(0)
                attn = torch.cat([batch.prompt_mask.index_select(0, rp), batch.completion_mask[idx, :L - 1]], dim=1)
                cout = body(input_ids=batch.completion_ids[idx, :L - 1], attention_mask=attn, position_ids=cpos,
                            cache=cache, use_cache=True)
                hidden = torch.cat([hidden, cout.last_hidden_state], dim=1)  # [b, L, H]
            m = live[idx, :L]
            pieces.append(hidden[m])
            places.append(flat[idx, :L][m])
    if pieces:
        hidden_live = torch.cat(pieces)[torch.argsort(torch.cat(places))]  # [N, H], N live tokens in row-major order
    else:  # no completion token at all
        hidden_live = last[:0, 0]
    w = model.lm_head.weight
    inv_t = None
    if bool((batch.temperature != 1.0).any()):  # what the rollout sampled from (1: no multiplication)
        inv_t = (1.0 / batch.temperature.to(torch.float64))[:, None].expand(live.shape)[live]  # exact for float64
    lp, ent = token_logprobs(hidden_live, w, batch.completion_ids[live], inv_t,
                             torch.bfloat16 if output_bf16 else None)
    if entropy is not None:
        entropy.append(_padded(ent, live))
    return _padded(lp, live)


def _padded(values: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``values`` (``[N]``, one per True of ``live``) laid out as ``[B, T]`` like ``live``, 0 elsewhere."""
    out = torch.zeros(live.shape, dtype=values.dtype, device=values.device)
    out[live] = values
    return out
