"""The torch engine's attention kernel on the main job's generation: ``sdpa`` against ``eager`` in one run.

    python benchmarks/rollout_attention.py [--config examples/arithmetic.yaml] [--rounds 6] [--threads 1]
                                           [--dtype bfloat16]

The main job's rollout batch: ``budget.batch_groups`` training tasks of ``--config`` (4) with their
``samples_per_task`` samples each (8), at most ``scheduler.max_tokens`` new tokens (24), temperature
``scheduler.temperature``, SmolLM2 in ``--dtype`` on ``--threads`` threads (the rollout's share of two
cores). One :class:`~rollout_service.torch_engine.TorchEngine` per kernel (``rollout.attention``); they take
turns on the same requests, ``--rounds`` times after a warm-up round, so a slow spell of a shared machine
hits both alike. Samples stop at EOS, so the two kernels need not generate the same number of tokens
(bf16 numerics differ): the figure is milliseconds per generated token, the median over the rounds, with the
ratio to ``sdpa`` (the baseline, printed beside it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KERNELS = ("sdpa", "eager")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic.yaml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = ap.parse_args()

    import torch

    from flywheel.config import load_config
    from flywheel.tasks import make_tasks
    from rollout_service.engine import GenerationRequest
    from rollout_service.torch_engine import TorchEngine
    from shared.model import encode_chat, load_model, load_tokenizer, resolve_model_dir
    from shared.schemas import SamplingParams, Task

    cfg = load_config(args.config)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.cache_dir)
    tok = load_tokenizer(model_dir)
    tasks = [Task(**t) for t in make_tasks(cfg.tasks) if t["split"] == "train"][:cfg.budget.batch_groups]
    sp = SamplingParams(max_new_tokens=cfg.scheduler.max_tokens, temperature=cfg.scheduler.temperature, seed=0)
    reqs = [GenerationRequest(encode_chat(tok, [m.model_dump() for m in t.prompt]), t.samples_per_task, sp)
            for t in tasks]
    engines = {k: TorchEngine(load_model(model_dir, args.dtype, k), tok, seed=0) for k in KERNELS}
    ms_per_token: dict[str, list[float]] = {k: [] for k in KERNELS}
    for r in range(args.rounds + 1):
        for k, engine in engines.items():
            t0 = time.perf_counter()
            out = engine.generate(reqs)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(s.completion_ids) for group in out for s in group)
            if r:  # round 0 warms up
                ms_per_token[k].append(1000 * elapsed / tokens)
    n = sum(r.n for r in reqs)
    print(f"{len(reqs)} prompts x {reqs[0].n} samples ({n}), <= {sp.max_new_tokens} new tokens, {args.dtype}, "
          f"{args.threads} thread(s), {args.rounds} rounds:")
    base = statistics.median(ms_per_token["sdpa"])
    for k in KERNELS:
        med = statistics.median(ms_per_token[k])
        ratio = "baseline" if k == "sdpa" else f"{med / base:.2f}x sdpa ({base:.2f} ms/token)"
        print(f"  {k:6s} {med:6.2f} ms per generated token ({', '.join(f'{x:.2f}' for x in ms_per_token[k])})  {ratio}")


if __name__ == "__main__":
    main()
