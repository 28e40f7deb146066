"""The canary: a fixed sequence every engine scores after each weight change, so that the trainer can tell
whether an engine serves the policy it published.

An engine that skips a weight update, loads the wrong version, drops a LoRA adapter or quantizes too coarsely
still generates plausible text and exits 0 (peers have shipped each of these). Each torch rollout engine scores
:func:`canary_tokens` under every policy version it generates with and attaches the log-probs to its
trajectories (:class:`shared.schemas.Attestation`); the trainer scores the same tokens under the weights it
published for that version and compares the mean absolute difference per token with :data:`TOLERANCE` for
the engine's numeric kind (``trainer_service/canary.py``). A group any of whose samples fails is not trained.

Used by the rollout and the trainer alike, so it lives here, with no service imports.
"""

from __future__ import annotations

from collections.abc import Sequence

CANARY_MESSAGES = [{"role": "system", "content": "Answer with only the final number."},
                   {"role": "user", "content": "A train leaves at 14:05 and arrives at 16:50. How many minutes?"}]
"""The canary's prompt (chat messages, rendered with the model's chat template)."""
CANARY_COMPLETION = "The trip takes 165 minutes: 2 hours and 45 minutes."
"""The canary's completion: text the model may or may not say, scored token by token."""

TOLERANCE = {"float32": 0.002, "bfloat16": 0.15, "int8": 2.0}
"""Largest mean |log p_engine − log p_trainer| per canary token (nats) accepted for an engine of each numeric
kind, against the trainer's float32 scoring of the same weights. Measured on SmolLM2 (18 canary tokens, mean
|log p| 2.0): float32 with sdpa against the trainer's eager attention 3e-6; bf16 weights 0.032; torch.ao dynamic
int8 1.16 (``rollout_service/quantize.py``). A weight perturbation of 1e-4 of each tensor's mean magnitude (a few
optimizer steps at lr 1e-5) moves the canary by 7e-4, so a float32 engine a step or more behind what it claims
is caught, a bf16 one only when its weights are far off (a frozen base, a missing adapter), an int8 one only
grossly. A kind not listed uses the float32 bound."""


def canary_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)`` of the canary under ``tokenizer``'s chat template (completion without
    special tokens)."""
    text = tokenizer.apply_chat_template(CANARY_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(prompt), list(tokenizer(CANARY_COMPLETION, add_special_tokens=False)["input_ids"])


def canary_logprobs(model, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """Log-probs (natural log, temperature 1, float32 log-softmax) of ``completion_ids`` after ``prompt_ids`` under
    ``model`` (a causal LM called with ``input_ids``), one forward without gradients: ``len(completion_ids)``
    floats (a non-finite one as -1e4)."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    target = torch.tensor(list(completion_ids))[:, None]
    lp = torch.log_softmax(logits, -1).gather(-1, target)[:, 0]
    # a broken model's NaN or inf would not survive JSON (written as null): a very low log-prob fails the check
    return torch.nan_to_num(lp, nan=-1e4, posinf=-1e4, neginf=-1e4).tolist()


def canary_diff(engine: Sequence[float], trainer: Sequence[float]) -> float:
    """Mean absolute difference per token of two canary scorings (nats).

    Raises:
        ValueError: they have different lengths (different tokenizers or canaries).
    """
    if len(engine) != len(trainer) or not engine:
        raise ValueError(f"canary scorings of {len(engine)} and {len(trainer)} tokens cannot be compared")
    return sum(abs(a - b) for a, b in zip(engine, trainer)) / len(engine)


def tolerance(precision: str) -> float:
    """:data:`TOLERANCE` of an engine's numeric kind (``float32``, ``bfloat16``, ``int8``)."""
    return TOLERANCE.get(precision, TOLERANCE["float32"])
