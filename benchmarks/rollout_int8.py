"""Generation speed and log-prob agreement of the torch engine's int8 weights against float32, in one run.

SmolLM2-135M-Instruct (the main job's model) samples the main job's batch shapes: ``--prompts`` reasoning-gym
``basic_arithmetic`` prompts x ``--n`` samples each, up to ``--tokens`` new tokens, temperature 1, on
``--threads`` torch threads. Arms (``rollout.quantization``):

- ``float32``: the baseline;
- ``int8``: the body's linear layers int8 (``rollout_service/quantize.py``), the output layer float32;
- ``int8_all``: the output layer int8 too (what the engine does not do: its log-probs are the behaviour policy's).

For each arm: generated tokens per second (best of ``--reps`` batches, each reseeded alike), the time to build
the int8 copy (paid once per weight version), and the mean and 99th percentile of |log p_arm − log p_fp32| over
the tokens the arm sampled, scored by the float32 model (the mismatch the trainer's decoupled correction sees,
``mismatch/onpolicy_abs_logp_diff``). Prints the CPU model first.

    python benchmarks/rollout_int8.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rollout_service.engine import GenerationRequest  # noqa: E402
from rollout_service.quantize import int8_runner  # noqa: E402
from rollout_service.torch_engine import TorchEngine  # noqa: E402
from shared.model import encode_chat, load_model, load_tokenizer, resolve_model_dir  # noqa: E402
from shared.precision import cpu_features, cpu_model  # noqa: E402
from shared.schemas import SamplingParams  # noqa: E402


def prompts(tok, k: int) -> list[list[int]]:
    """``k`` main-job prompts (reasoning-gym basic_arithmetic, 2 one-digit terms), chat-encoded."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=k, seed=0, min_terms=2, max_terms=2, min_digits=1,
                                      max_digits=1, operators=["+", "-"], allow_negation=False,
                                      allow_parentheses=False)
    return [encode_chat(tok, [{"role": "system", "content": "Answer with only the final number."},
                              {"role": "user", "content": ds[i]["question"]}]) for i in range(k)]


def fp32_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-probs at temperature 1 of ``completion`` after ``prompt`` under ``model``: ``[len(completion)]``."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["float32", "int8", "int8_all"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    tok = load_tokenizer(model_dir)
    base = load_model(model_dir)
    ps = prompts(tok, args.prompts)
    print(f"CPU: {cpu_model()} [{cpu_features()}]; SmolLM2-135M, {args.prompts} prompts x {args.n} samples, <= {args.tokens} tokens, "
          f"{args.threads} thread(s), best of {args.reps}")
    rows = {}
    for arm in args.arms:
        engine = TorchEngine(base, tok, seed=0, quantization="none" if arm == "float32" else "int8")
        build_s = 0.0
        if arm == "int8_all":
            t = time.perf_counter()
            engine._runner = int8_runner(base, keep_output_layer=False)
            build_s = time.perf_counter() - t
        elif arm == "int8":
            t = time.perf_counter()
            engine.runner  # noqa: B018 - builds the int8 copy
            build_s = time.perf_counter() - t
        reqs = [GenerationRequest(prompt_ids=p, n=args.n, sampling=SamplingParams(
            temperature=1.0, max_new_tokens=args.tokens, seed=7)) for p in ps]
        best, samples = float("inf"), None
        for _ in range(args.reps):
            t = time.perf_counter()
            out = engine.generate(reqs)
            dt = time.perf_counter() - t
            n_tok = sum(len(s.completion_ids) for g in out for s in g)
            if dt / n_tok < best:
                best, samples = dt / n_tok, out
        diffs = []
        for p, group in zip(ps, samples):
            for s in group:
                ref = fp32_logprobs(base, p, s.completion_ids)
                diffs += (torch.tensor(s.logprobs) - ref).abs().tolist()
        diffs.sort()
        rows[arm] = (1.0 / best, build_s, statistics.fmean(diffs), diffs[int(0.99 * (len(diffs) - 1))])
    f32 = rows.get("float32", (None,))[0]
    print(f"{'arm':<10}{'tokens/s':>10}{'vs fp32':>9}{'build s':>9}{'|dlogp| mean':>14}{'p99':>8}")
    for arm, (tps, build, mean, p99) in rows.items():
        ratio = f"{tps / f32:.2f}x" if f32 else "-"
        print(f"{arm:<10}{tps:>10.1f}{ratio:>9}{build:>9.2f}{mean:>14.4f}{p99:>8.3f}")


if __name__ == "__main__":
    main()
