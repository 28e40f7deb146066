"""Seconds per trainer step of the main job's settings in each precision, on one batch, one thread.

One batch is generated once (SmolLM2-135M-Instruct from ``examples/arithmetic.yaml``: 4 groups × 8 samples,
24 new tokens, fp32 engine, seed 0); then each arm builds a fresh :class:`PolicyTrainer` on a fresh copy of
the model and takes ``--steps`` optimizer steps on that same batch with ``torch.set_num_threads(1)`` (the
trainer's share of the two cores in ``flywheel run``). Arms:

- ``fp32``: float32 throughout, PPO clip against the behaviour policy (the baseline of every ratio);
- ``bf16``: the body under bf16 autocast (``trainer.autocast_bf16``), output layer float32;
- ``bf16_head``: also the output layer's matmuls in bf16 (``trainer.output_bf16``);
- ``lora``, ``lora_bf16``: LoRA adapters only (``trainer.lora``, r 16, all linear layers of the body), in
  float32 and in the ``bf16_head`` precision;

each without and with the main job's KL term (``kl_coef`` 0.05: a reference forward). The arms take their
steps in turn (a slow spell of a shared machine hits them alike). Prints the median seconds per step after
the first (warm-up) step, its ratio to fp32 with the fp32 figure beside it, the mean and largest
|Δ log π| of the arm's log-probs of the batch against fp32's at the same weights (numerics only), the bytes
one policy version publishes (full weights, or the adapters), the seconds to write that version's checkpoint
(weights, optimizer and trainer state) and the step with it, and the process's peak RSS.

    python benchmarks/trainer_step.py [--steps 4] [--arms fp32 bf16 bf16_head] [--kl both|on|off]
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {
    "fp32": {"autocast_bf16": False, "output_bf16": False, "off_policy": "ppo_clip"},
    "bf16": {"autocast_bf16": True, "output_bf16": False, "off_policy": "decoupled"},
    "bf16_head": {"autocast_bf16": True, "output_bf16": True, "off_policy": "decoupled"},
    "lora": {"autocast_bf16": False, "output_bf16": False, "off_policy": "ppo_clip",
             "lora": {"r": 16, "alpha": 32.0}},
    "lora_bf16": {"autocast_bf16": True, "output_bf16": True, "off_policy": "decoupled",
                  "lora": {"r": 16, "alpha": 32.0}},
}
"""Trainer settings per arm (``trainer.autocast_bf16``, ``trainer.output_bf16``, ``trainer.loss.off_policy``,
``trainer.lora``: rank 16 on every linear layer of the body, the docs' default)."""


def _groups(cfg, tok, engine, tasks, rng):
    """One batch of the main job's shape as trainer groups (behaviour log-probs from the fp32 engine), rewards
    alternating 0 and 1 so that every group has a gradient."""
    from benchmarks.e2e_arithmetic import _generate, as_groups

    batch, prompts, samples = _generate(cfg, tok, engine, tasks, rng)
    return as_groups(cfg, tok, batch, prompts, samples, [[float(i % 2) for i in range(len(ss))] for ss in samples], 0)


def _publish_s(trainer, reps: int = 2) -> float:
    """Median seconds to write one version of ``trainer`` to a fresh checkpoint store as the service does (weights
    or adapters, then optimizer and trainer state: ``shared.checkpoint.CheckpointStore``), CPU work that shares
    the machine's two cores with the next step and the rollout."""
    import tempfile

    from shared.checkpoint import CheckpointStore

    times = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory(dir=ROOT) as d:
            store = CheckpointStore(d, keep=1)
            t0 = time.perf_counter()
            update = store.save_weights(trainer.published_weights(), "bench", 1, 1, [], trainer.adapter)
            store.save_trainer_state(update, trainer.state_dict(set(), copy_optimizer=False))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic.yaml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--arms", nargs="+", default=["fp32", "bf16", "bf16_head", "lora"], choices=list(ARMS))
    ap.add_argument("--kl", choices=["both", "on", "off"], default="both")
    args = ap.parse_args()

    import torch

    from benchmarks.e2e_arithmetic import _setup
    from shared.precision import cpu_features, cpu_model
    from trainer_service.forward import collate, completion_logprobs
    from trainer_service.trainer import PolicyTrainer

    cfg, tok, engine, tasks, reward, rng = _setup(args.config)
    cfg.budget.batch_groups = 4
    groups = _groups(cfg, tok, engine, tasks, rng)
    rows = [s for g in groups for s in g.samples.values()]
    tokens = sum(len(r.trajectory.completion_ids) for r in rows)
    base = engine.model
    torch.set_num_threads(1)
    batch = collate(rows, tok.pad_token_id)
    with torch.no_grad():
        ref_lp = completion_logprobs(base, batch)
    print(f"CPU: {cpu_model()} [{cpu_features()}]", flush=True)
    print(f"batch: {len(rows)} rows, {tokens} completion tokens (padded to {batch.completion_ids.numel()}), "
          f"{batch.prompt_ids.shape[0]} prompts of up to {batch.prompt_ids.shape[1]} tokens; 1 thread", flush=True)
    kls = {"both": [0.0, 0.05], "on": [0.05], "off": [0.0]}[args.kl]
    results: dict[tuple[str, float], float] = {}
    for kl in kls:  # the arms take their steps in turn, so that a slow spell of the machine hits them alike
        trainers, diffs, times, published = {}, {}, {arm: [] for arm in args.arms}, {}
        for arm in args.arms:
            a = ARMS[arm]
            tcfg = cfg.trainer.model_validate({**cfg.trainer.model_dump(), "lora": a.get("lora"),
                "kl_coef": kl, "autocast_bf16": a["autocast_bf16"], "output_bf16": a["output_bf16"],
                "loss": cfg.trainer.loss.model_copy(update={"off_policy": a["off_policy"]})})
            trainers[arm] = PolicyTrainer(copy.deepcopy(base), tcfg, tok.pad_token_id)
            published[arm] = sum(t.numel() * t.element_size() for t in trainers[arm].published_weights().values())
            with torch.no_grad():
                extra = {"output_bf16": True} if a["output_bf16"] else {}  # (runs on checkouts without it too)
                lp = completion_logprobs(trainers[arm].model, batch, tcfg.autocast_bf16, **extra)
            diffs[arm] = (lp - ref_lp)[batch.completion_mask.bool()].abs()
        for _ in range(args.steps):
            for arm in args.arms:
                t0 = time.perf_counter()
                trainers[arm].train_step(groups)
                times[arm].append(time.perf_counter() - t0)
        saves = {arm: _publish_s(trainers[arm]) for arm in args.arms}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        for arm in args.arms:
            ts = times[arm]
            med = statistics.median(ts[1:] if len(ts) > 1 else ts)
            results[(arm, kl)] = med
            base_s = results.get(("fp32", kl))
            ratio = f"{med / base_s:.2f}x fp32 ({base_s:.2f} s)" if base_s and arm != "fp32" else "baseline"
            nbytes = published[arm]
            full = published.get("fp32")
            share = f" ({nbytes / full:.1%} of fp32's)" if full and arm != "fp32" else ""
            whole = med + saves[arm]
            results[(arm, kl, "whole")] = whole
            base_w = results.get(("fp32", kl, "whole"))
            wratio = f"{whole / base_w:.2f}x fp32 ({base_w:.2f} s)" if base_w and arm != "fp32" else "baseline"
            print(f"{arm:10s} kl={kl:<4g} {med:6.2f} s/step ({', '.join(f'{t:.2f}' for t in ts)})  {ratio};  "
                  f"|Δlogπ| vs fp32 mean {diffs[arm].mean():.4f} max {diffs[arm].max():.3f};  "
                  f"a version publishes {nbytes / 2**20:.1f} MiB{share}; with its checkpoint written "
                  f"(+{saves[arm]:.2f} s) {whole:.2f} s/step, {wratio}", flush=True)
        print(f"peak RSS of the process with {len(args.arms)} trainers: {rss:.2f} GiB", flush=True)
        del trainers


if __name__ == "__main__":
    main()
