"""``rollout.engine: null``: a rollout engine without a model, for benchmarking the pipeline.

What it is for: measuring what the message bus and the services cost without a model
(``benchmarks/null_pipeline.py``, with ``trainer.null_step: true``), and how they scale with replicas. It is
a real engine behind the :class:`rollout_service.engine.Engine` interface, not a test double: requests go
through batching, the engine gate, emission and the acks exactly as with the torch engine. Never for training.

A completion is ``max_new_tokens`` token ids (``rollout.null_completion: fixed``: ids counting up from 0
modulo the vocabulary; ``random``: drawn uniformly from ``rollout.null_vocab`` ids, seeded per batch) with
the behaviour log-prob of uniform sampling, ``-log(null_vocab)`` per token (exact for ``random``), finish
reason ``length``. Generation takes ``tokens / rollout.null_tokens_per_s`` seconds (``null_rate_per``:
``sample``, every sample of the batch at that rate at once, so a batch takes its longest sample's tokens at
the rate; ``batch``, the batch's tokens in total at that rate); a rate of 0 returns at once.

Weights: a WeightUpdate is "loaded" by taking its version (no file is read, whatever its transport), so the
engine follows the trainer's versions like a real one and the staleness bookkeeping stays real.

:class:`NullTokenizer` stands in for the model's tokenizer (no model directory is needed): a prompt's
chat messages are rendered as ``<role>: content`` lines and encoded as their UTF-8 bytes modulo the vocabulary
(not a real tokenization: a prompt of n bytes is n ids); ids decode to lowercase letters (``a`` + id mod 26).
"""

from __future__ import annotations

import math
import random
import time

from rollout_service.engine import Engine, GenerationRequest, Sample
from shared.schemas import VersionSpan, WeightUpdate


class NullTokenizer:
    """A model-free tokenizer: the chat template and encoding the rollout service needs, byte-level.

    Args:
        vocab: ids are in ``[0, vocab)``.
    """

    eos_token_id = None
    pad_token_id = 0

    def __init__(self, vocab: int = 64) -> None:
        self.vocab = vocab

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        """The messages as ``<role>: content`` lines, plus ``assistant:`` with ``add_generation_prompt``."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """``{"input_ids": ...}``: the UTF-8 bytes of ``text`` modulo the vocabulary."""
        return {"input_ids": [b % self.vocab for b in text.encode("utf-8")]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """One lowercase letter per id (``a`` + id mod 26)."""
        return "".join(chr(97 + i % 26) for i in ids)


class NullEngine(Engine):
    """Completions without a model at a set token rate (see the module docstring).

    Args:
        vocab: ids are drawn from ``[0, vocab)``; the behaviour log-prob of each token is ``-log(vocab)``.
        tokens_per_s: generation rate in tokens per second (0: as fast as possible).
        rate_per: ``sample`` (each sample of a batch generates at ``tokens_per_s`` in parallel) or
            ``batch`` (the batch's tokens in total at ``tokens_per_s``).
        completion: ``random`` (uniform ids, seeded by ``seed`` and the batch counter) or ``fixed`` (ids
            0, 1, 2... modulo ``vocab``: every sample alike).
        seed: base seed of ``random`` completions.

    Raises:
        ValueError: ``vocab`` < 2, a negative rate, or an unknown ``rate_per`` / ``completion``.
    """

    def __init__(self, vocab: int = 64, tokens_per_s: float = 0.0, rate_per: str = "sample",
                 completion: str = "random", seed: int = 0) -> None:
        if vocab < 2 or tokens_per_s < 0 or rate_per not in ("sample", "batch") or completion not in ("random", "fixed"):
            raise ValueError(f"null engine: bad settings vocab={vocab} tokens_per_s={tokens_per_s} "
                             f"rate_per={rate_per!r} completion={completion!r}")
        self.vocab, self.tokens_per_s, self.rate_per, self.completion = vocab, tokens_per_s, rate_per, completion
        self.seed = seed
        self.batches = 0
        self.logprob = -math.log(vocab)
        """Behaviour log-prob of every token (natural log): uniform over the vocabulary."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """``r.n`` completions of ``r.sampling.max_new_tokens`` tokens per request, after the rate's delay
        (seconds: the longest sample's tokens / rate per ``sample``, the batch's tokens / rate per ``batch``)."""
        t0 = time.perf_counter()
        rng = random.Random(self.seed * 1_000_003 + self.batches)
        self.batches += 1
        out, total, longest = [], 0, 0
        version = self.policy_version
        for r in requests:
            k = r.sampling.max_new_tokens
            samples = []
            for _ in range(r.n):
                if self.completion == "fixed":
                    ids = [i % self.vocab for i in range(k)]
                else:
                    ids = [rng.randrange(self.vocab) for _ in range(k)]
                samples.append(Sample(ids, [self.logprob] * k, "length", [VersionSpan(version=version, start=0, end=k)]))
            total += k * r.n
            longest = max(longest, k)
            out.append(samples)
        if self.tokens_per_s > 0:
            wait = (longest if self.rate_per == "sample" else total) / self.tokens_per_s - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
        return out

    def update_weights(self, update: WeightUpdate) -> None:
        """Take ``update``'s version (there are no weights to load)."""
        self.policy_version = update.version

    def load_weights_state(self, state: dict, version: int) -> None:
        """Take ``version`` (a broadcast's tensors are ignored)."""
        self.policy_version = version

    def interrupt_with(self, update: WeightUpdate) -> bool:
        """Nothing to interrupt mid-generation: the version is taken between batches."""
        return False
