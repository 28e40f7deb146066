"""The fused, chunked output layer (``trainer_service/token_logprobs.py``) against the plain computation:
``log_softmax(h @ Wᵀ / τ)`` gathered at the targets, its entropy, and both gradients."""

from __future__ import annotations

import pytest
import torch

from trainer_service.token_logprobs import token_logprobs


def _reference(hidden, weight, targets, inv_t):
    z = hidden @ weight.T
    if inv_t is not None:
        z = z * inv_t[:, None]
    logp = torch.log_softmax(z, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), ent


def _inputs(n=13, h=8, v=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype) * 2
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g, dtype=dtype))
    up = torch.randn(n, generator=g, dtype=dtype)  # an upstream gradient per token (advantage-like)
    return hidden, weight, targets, inv_t, up


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
@pytest.mark.parametrize("with_temperature", [False, True])
def test_values_and_gradients_match_the_plain_log_softmax_in_float64(chunk, with_temperature):
    hidden, weight, targets, inv_t, up = _inputs()
    inv_t = inv_t if with_temperature else None
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, targets, inv_t, chunk_tokens=chunk)
    (lp * up).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rlp, rent = _reference(h2, w2, targets, inv_t)
    (rlp * up).sum().backward()
    assert lp.dtype == torch.float64 and ent.dtype == torch.float64 and lp.shape == (13,)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, rent.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-12)
    assert not ent.requires_grad


def test_a_tied_weight_accumulates_both_gradients():
    """The weight is also the input embedding (SmolLM2 ties them): the two gradients add up."""
    hidden, weight, targets, _, up = _inputs(seed=1)
    w = weight.clone().requires_grad_()
    lp, _ = token_logprobs(torch.nn.functional.embedding(targets, w) + hidden, w, targets)
    (lp * up).sum().backward()
    w2 = weight.clone().requires_grad_()
    rlp, _ = _reference(torch.nn.functional.embedding(targets, w2) + hidden, w2, targets, None)
    (rlp * up).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=1e-12)


def test_bf16_compute_stays_within_its_rounding_of_float32():
    """bf16 matmuls, float32 log-sum-exp: log-probs within a few 2⁻⁹-relative roundings of the logits, the
    gradients' direction kept (cosine > 0.999)."""
    hidden, weight, targets, inv_t, up = _inputs(n=64, h=64, v=512, dtype=torch.float32, seed=2)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, targets, inv_t, compute_dtype=torch.bfloat16, chunk_tokens=16)
    (lp * up).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rlp, rent = _reference(h2, w2, targets, inv_t)
    (rlp * up).sum().backward()
    assert lp.dtype == torch.float32 and w1.grad.dtype == torch.float32 and h1.grad.dtype == torch.float32
    scale = (hidden @ weight.T).abs().max().item() * inv_t.max().item()  # the largest logit
    assert (lp - rlp).abs().max().item() < 4 * scale * 2 ** -9
    assert (lp - rlp).abs().max().item() > 0  # it did compute in bf16
    assert (ent - rent.detach()).abs().max().item() < 4 * scale * 2 ** -9
    for a, b in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999


def test_without_gradient_there_is_no_graph_and_bad_shapes_are_refused():
    hidden, weight, targets, _, _ = _inputs()
    with torch.no_grad():
        lp, _ = token_logprobs(hidden.requires_grad_(), weight, targets)
    assert lp.grad_fn is None
    with pytest.raises(ValueError, match=r"hidden must be \[N, 8\]"):
        token_logprobs(torch.zeros(3, 7, dtype=torch.float64), weight, targets[:3])


def test_bf16_gradients_of_confident_tokens_keep_their_direction():
    """A token the policy is sure of (p_y ≈ 0.999) has gradient (1 − p_y)·W_y − Σ_j p_j·W_j ≈ 0.001·(…): from a
    bf16 p_y alone 1 − p_y would be 0 or 0.004. The target's entry comes from the float32 log-prob."""
    g = torch.Generator().manual_seed(3)
    weight = torch.eye(64)  # logits = hidden: each row's target 11.2 above 63 others of ~N(0, 0.25)
    targets = torch.randint(0, 64, (32,), generator=g)
    hidden = 0.5 * torch.randn(32, 64, generator=g)
    hidden[torch.arange(32), targets] += 11.2
    up = torch.randn(32, generator=g)
    h1 = hidden.clone().requires_grad_()
    lp, _ = token_logprobs(h1, weight, targets, compute_dtype=torch.bfloat16, chunk_tokens=8)
    assert 0.99 < lp.exp().min() and lp.exp().max() < 0.9999  # confident, not certain
    (lp * up).sum().backward()
    h2 = hidden.clone().requires_grad_()
    (_reference(h2, weight, targets, None)[0] * up).sum().backward()
    cos = torch.nn.functional.cosine_similarity(h1.grad, h2.grad, dim=1)
    assert cos.min() > 0.99, cos


def test_no_position_at_all_gives_empty_results_and_zero_gradients():
    """A micro-batch whose completions are all empty sends no position through the output layer."""
    hidden, weight, targets, _, _ = _inputs()
    h, w = hidden[:0].clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs(h, w, targets[:0])
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    assert h.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(weight))


def test_a_second_backward_is_refused_clearly_and_a_temperature_gets_no_gradient():
    hidden, weight, targets, inv_t, _ = _inputs()
    lp, _ = token_logprobs(hidden.clone().requires_grad_(), weight, targets)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        lp.sum().backward()
    it = inv_t.clone().requires_grad_()
    lp, _ = token_logprobs(hidden.clone().requires_grad_(), weight, targets, it)
    lp.sum().backward()
    assert it.grad is None
