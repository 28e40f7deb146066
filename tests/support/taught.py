"""A tiny random Llama taught to give one answer: a real model whose greedy output is known."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer


def teach_tiny_model(model_dir: Path, prompt_msgs: list[dict], target: str, steps: int = 300):
    """Build a tiny Llama (hidden 96, 2 layers, seed 0) in ``model_dir`` and teach it, by supervised steps
    (Adam, lr 3e-3, at most ``steps``; under a second), to answer ``prompt_msgs`` with ``target`` and stop.

    Returns ``(tokenizer, model)``, the model in train mode and not saved.
    """
    torch.manual_seed(0)
    d = build_tiny_model(model_dir, hidden=96, layers=2)
    tok, model = load_tokenizer(d), load_model(d)
    prompt = encode_chat(tok, prompt_msgs)
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
