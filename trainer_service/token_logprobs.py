"""The output layer fused with the log-softmax: log π(token) and the entropy of each position, in chunks.

The plain path (``logits = h @ Wᵀ``, ``log_softmax``, ``gather``, and ``-(exp(logp) · logp).sum(-1)`` for
the entropy metric) keeps four ``[N, V]`` float32 tensors alive for autograd and makes as many passes over
them; with SmolLM2's V = 49,152 that is 0.2 GB per 1,000 tokens each, and on this CPU about 2.4 s of a
32-row step. :func:`token_logprobs` computes, per chunk of ``chunk_tokens`` positions, the logits (in
``compute_dtype``: bfloat16 runs on the CPU's matrix units), then in float32 the log-sum-exp, the target's
log-prob and the entropy, and keeps for backward only the softmax ``p`` of the chunk in ``compute_dtype``
(the gradient of log p_y is ``(onehot(y) − p) / τ``). Only the positions passed in are computed: the caller
drops padding first.

The same fused form is what Liger-Kernel's fused linear cross-entropy and verl's ``use_fused_kernels``
(``verl/utils/kernel/linear_cross_entropy.py``) compute on GPUs; this is its CPU version for the RL case,
where the upstream gradient is per token (the advantage-weighted surrogate), not one scalar.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 256
"""Positions per chunk: 256 × 49,152 float32 logits are 50 MB."""

_SCRATCH: dict[tuple, torch.Tensor] = {}
"""Scratch buffers reused across calls, keyed by (role, rows, V, dtype, device): a fresh 50 MB tensor costs
its page faults on every touch (``torch.exp`` into a new tensor: 102 ms; into a reused one: 30 ms)."""


def _scratch(role: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (role, rows, cols, dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None:
        if len(_SCRATCH) > 16:  # shapes change (another model, a test): keep the cache small
            _SCRATCH.clear()
        buf = _SCRATCH[key] = torch.empty(rows, cols, dtype=dtype, device=device)
    return buf


class _TokenLogprobs(torch.autograd.Function):
    """Autograd function of :func:`token_logprobs` (see there for shapes and dtypes)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                inv_temperature: torch.Tensor | None, compute_dtype: torch.dtype, chunk_tokens: int, keep: bool):
        acc = torch.promote_types(weight.dtype, torch.float32)
        n, V = hidden.shape[0], weight.shape[0]
        w = weight.detach().to(compute_dtype)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty(n, dtype=acc, device=hidden.device)
        probs = []
        rows = chunk_tokens  # scratch of a fixed shape, whatever the call's size: reused by every call
        for s in range(0, n, chunk_tokens):
            e_ = min(n, s + chunk_tokens)
            k = e_ - s
            zc = torch.mm(hidden[s:e_].detach().to(compute_dtype), w.T,
                          out=_scratch("logits", rows, V, compute_dtype, hidden.device)[:k])  # [k, V]
            m = zc.amax(-1, keepdim=True)
            if compute_dtype == acc:
                z = zc
            else:
                z = _scratch("z", rows, V, acc, hidden.device)[:k]
                z.copy_(zc)
            z.sub_(m)  # z = logits − max (exp cannot overflow)
            if inv_temperature is not None:
                z.mul_(inv_temperature[s:e_, None].to(acc))
            e = torch.exp(z, out=_scratch("exp", rows, V, acc, hidden.device)[:k])
            total = e.sum(-1, keepdim=True)
            log_total = total.log()
            logp[s:e_] = z.gather(1, targets[s:e_, None]).squeeze(1) - log_total.squeeze(1)
            # entropy = log Σe − Σ e·z / Σe (z shifted); z is not needed after this
            entropy[s:e_] = (log_total - z.mul_(e).sum(-1, keepdim=True) / total).squeeze(1)
            if keep:  # the softmax for backward, in the compute dtype (fresh: it lives until backward)
                p = torch.empty(k, V, dtype=compute_dtype, device=hidden.device)
                probs.append(torch.mul(e, total.reciprocal(), out=p))
        ctx.probs = probs
        ctx.w = w if keep else None  # the weight in the compute dtype, cast once per forward/backward pair
        ctx.meta = (compute_dtype, chunk_tokens)
        ctx.save_for_backward(hidden, weight, targets, inv_temperature, logp)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, inv_temperature, logp = ctx.saved_tensors
        compute_dtype, chunk_tokens = ctx.meta
        probs, ctx.probs = ctx.probs, None
        if probs is None:  # backward overwrites the kept softmax in place
            raise RuntimeError("token_logprobs: its graph can be backpropagated only once (no retain_graph)")
        acc = torch.promote_types(weight.dtype, torch.float32)
        w, ctx.w = ctx.w, None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = None
        for i, s in enumerate(range(0, hidden.shape[0], chunk_tokens)):
            e_ = min(hidden.shape[0], s + chunk_tokens)
            g = grad_logp[s:e_].to(acc)
            if inv_temperature is not None:
                g = g * inv_temperature[s:e_].to(acc)  # d(z / τ) = dz / τ
            # d log p_y / dz = onehot(y) − p: −g·p everywhere (in place on the kept softmax), then the target's
            # entry written as g·(1 − p_y) from the float32 log-prob (a bf16 p_y near 1 would lose 1 − p_y)
            gz = probs[i].mul_(-g[:, None].to(compute_dtype))
            probs[i] = None
            gz.scatter_(1, targets[s:e_, None], (g * -torch.expm1(logp[s:e_])).to(compute_dtype)[:, None])
            if want_h:
                grad_h[s:e_] = (gz @ w).to(hidden.dtype)
            if want_w:
                part = gz.T @ hidden[s:e_].detach().to(compute_dtype)  # [V, H]
                grad_w = part.to(acc) if grad_w is None else grad_w.add_(part)
        if want_w:  # (no position at all: a zero gradient)
            grad_w = torch.zeros_like(weight) if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   inv_temperature: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                   chunk_tokens: int = CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(target) and the entropy at each of N positions, through the output layer ``weight``.

    Args:
        hidden: ``[N, H]`` float, the final hidden states of the positions (any float dtype).
        weight: ``[V, H]``, the output layer (``lm_head.weight``; tied or not).
        targets: ``[N]`` long, the token whose log-prob is wanted at each position.
        inv_temperature: ``[N]`` float or ``None``, 1 / the sampling temperature of each position (the logits
            are multiplied by it in the accumulation dtype; ``None``: temperature 1, no multiplication). No
            gradient flows to it.
        compute_dtype: dtype of the two matmuls and of the softmax kept for backward; ``None``: the weight's.
            bfloat16 logits differ from float32 ones by a relative 2⁻⁹ (the rollout's bf16 engine computes
            its behaviour log-probs the same way); the log-sum-exp and the log-probs are float32 either way.
        chunk_tokens: positions per chunk (scratch memory ~ chunk_tokens × V × 10 bytes, reused across
            calls, plus the softmax kept for backward: N × V × the compute dtype's size).

    Returns:
        ``(logp, entropy)``: ``[N]`` each, float32 (float64 for a float64 weight). ``logp`` carries the
        gradient to ``hidden`` and ``weight``; ``entropy`` (nats) has none.

    Raises:
        ValueError: ``hidden`` is not 2-D or its width is not the weight's.
        RuntimeError: a second backward through the same result (the kept softmax is consumed in place).
    """
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, {weight.shape[1]}], got {tuple(hidden.shape)}")
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)  # else no softmax kept
    if inv_temperature is not None:
        inv_temperature = inv_temperature.detach()  # a sampling setting: no gradient to it
    return _TokenLogprobs.apply(hidden, weight, targets, inv_temperature, compute_dtype or weight.dtype,
                                max(1, int(chunk_tokens)), keep)
