"""The ``torch`` engine: an in-process transformers model, the CPU default and what the tests use."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import torch

from rollout_service.engine import Engine, GenerationRequest, Sample
from shared.checkpoint import load_weights, load_weights_state, snapshot_weights
from shared.schemas import VersionSpan, WeightUpdate

log = logging.getLogger("rollout.torch")


class TorchEngine(Engine):
    """Batched sampling with ``model.generate`` and exact behaviour log-probs.

    Requests with equal sampling settings share one left-padded batch; each prompt is repeated
    ``n`` times. Log-probs come from the raw logits (``output_logits``) scaled by the temperature,
    so they are the log-probabilities of the distribution actually sampled (``top_p`` < 1 is
    applied by the sampler but not reflected in the log-probs).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, seed: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        self.seed = seed
        self.batches = 0
        self.policy_version = 0
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        self._lock = threading.Lock()

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        eos = model.generation_config.eos_token_id if model.generation_config else None
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    def update_weights(self, update: WeightUpdate) -> None:
        with self._lock:
            load_weights(self.model, update)
            self.policy_version = update.version

    def weight_shapes(self) -> dict:
        return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in snapshot_weights(self.model).items()}

    def load_weights_state(self, state: dict, version: int) -> None:
        with self._lock:
            load_weights_state(self.model, state, f"broadcast v{version}")
            self.policy_version = version

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        out: list[list[Sample] | None] = [None] * len(requests)
        by_params: dict[tuple, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            s = r.sampling
            by_params[(s.temperature, s.top_p, s.max_new_tokens)].append(i)
        with self._lock, torch.no_grad():
            for (temp, top_p, max_new), idx in by_params.items():
                results = self._generate_batch([requests[i] for i in idx], temp, top_p, max_new)
                for i, res in zip(idx, results):
                    out[i] = res
        return out  # type: ignore[return-value]

    def _generate_batch(self, reqs: list[GenerationRequest], temperature: float, top_p: float,
                        max_new_tokens: int) -> list[list[Sample]]:
        self.batches += 1
        seed = next((r.sampling.seed for r in reqs if r.sampling.seed is not None), None)
        torch.manual_seed(seed if seed is not None else self.seed * 1_000_003 + self.batches)
        prompts = [r.prompt_ids for r in reqs for _ in range(r.n)]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        greedy = temperature == 0.0
        gen = self.model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
            do_sample=not greedy, temperature=None if greedy else temperature, top_p=None if greedy else top_p,
            top_k=None, min_p=None, eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True,
        )
        new = gen.sequences[:, width:]
        logits = torch.stack(gen.logits, dim=1).float()  # [N, T, V]
        if not greedy:
            logits = logits / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        samples: list[Sample] = []
        for row, row_lp in zip(new.tolist(), lp.tolist()):
            cut, reason = len(row), "length"
            for j, t in enumerate(row):
                if t in self.eos_ids:
                    cut, reason = j + 1, "stop"  # the EOS token is part of the completion and trains
                    break
            samples.append(Sample(row[:cut], row_lp[:cut], reason,
                                  [VersionSpan(version=self.policy_version, start=0, end=cut)]))
        grouped, k = [], 0
        for r in reqs:
            grouped.append(samples[k:k + r.n])
            k += r.n
        return grouped
