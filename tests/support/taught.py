"""A tiny random Llama taught to give one answer: a real model whose greedy output is known."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer


def teach_tiny_model(model_dir: Path, prompt_msgs: list[dict], target: str, steps: int = 300,
                     render=encode_chat):
    """Build a tiny Llama (hidden 96, 2 layers, seed 0) in ``model_dir`` and teach it, by supervised steps
    (Adam, lr 3e-3, at most ``steps``; under a second), to answer ``prompt_msgs`` with ``target`` and stop.
    ``render(tokenizer, prompt_msgs)`` gives the prompt ids (default: the chat template with the generation
    prompt).

    Returns ``(tokenizer, model)``, the model in train mode and not saved.
    """
    torch.manual_seed(0)
    d = build_tiny_model(model_dir, hidden=96, layers=2)
    tok, model = load_tokenizer(d), load_model(d)
    prompt = render(tok, prompt_msgs)
    ids = torch.tensor([prompt + tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    return tok, model


def teach_tiny_mixture(model_dir: Path, examples: list[tuple[list[dict], str, float]], steps: int = 400,
                       lr: float = 3e-3, render=encode_chat):
    """Build a tiny Llama (hidden 96, 2 layers, seed 0) in ``model_dir`` and teach it a *distribution* of
    answers: ``examples`` are ``(prompt_msgs, target, weight)``, several targets per prompt, and the model
    learns to answer each prompt with its targets (each followed by EOS) in proportion to their weights.

    Full-batch supervised steps (Adam, ``lr``, ``steps`` of them; a few seconds) on the weighted mean of the
    sequences' summed token log-loss, whose minimum is the weighted empirical distribution of the targets
    given the prompt (the loss cannot go to 0, so all ``steps`` run). Returns ``(tokenizer, model)``, the
    model in train mode and not saved. ``render`` as in :func:`teach_tiny_model`.
    """
    torch.manual_seed(0)
    d = build_tiny_model(model_dir, hidden=96, layers=2)
    tok, model = load_tokenizer(d), load_model(d)
    rows, weights = [], []
    for msgs, target, w in examples:
        prompt = render(tok, msgs)
        rows.append((prompt, tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
        weights.append(float(w))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, t) in enumerate(rows):
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
        mask[i, :len(p) + len(t)] = 1
    w = torch.tensor(weights) / sum(weights)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                                reduction="none").sum(dim=1)
        loss = (w * nll).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tok, model
