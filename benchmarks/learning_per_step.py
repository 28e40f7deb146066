"""Held-out accuracy per trainer step of the plain single-process GRPO loop (the issue's reference).

The issue's reference measurement (a synchronous loop, 4 prompts x 8 samples, 24 new tokens,
lr 1e-5, no KL, fp32) reports greedy accuracy 0.42 → 0.75 after 5 steps → 0.86 after 30 on its own
64 held-out items. This script runs that loop — ``benchmarks/e2e_arithmetic.py``'s ``plain_loop``
update, same settings as ``examples/arithmetic.yaml`` less the KL term — and evaluates it every
``--eval-every`` steps on two 64-item sets, so Flywheel's learning per step can be compared with the
reference loop's on the same items:

- ``flywheel``: Flywheel's held-out split (disjoint from training by prompt text; what
  ``flywheel run`` reports);
- ``seed42``: the raw reasoning-gym dataset with seed 42 (``size=64``). reasoning-gym draws item i
  from seed + i, so these items are among the training items of nearby seeds.

``--resample-unsolved N`` adds Flywheel's ``budget.resample_unsolved``: each group whose samples
all fail is replaced by one fresh group of N samples of the same task (generated at once).

    python benchmarks/learning_per_step.py --steps 30 --seed 0 [--resample-unsolved 24]

Prints one line per step (seconds, mean reward, gradient norm) and the accuracies (with the count
of negative-answer items right) at step 0 and every ``--eval-every`` steps. Single runs are noisy
(64 items: standard error about 0.06); compare several seeds.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e_arithmetic import _generate, _setup, plain_update, reference_reward  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arithmetic.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="task order and sampling seed")
    ap.add_argument("--resample-unsolved", type=int, default=0, metavar="N")
    args = ap.parse_args()

    import reasoning_gym
    import torch

    from rollout_service.engine import GenerationRequest
    from shared.model import encode_chat
    from shared.schemas import SamplingParams
    from flywheel.tasks import make_tasks

    cfg, tok, engine, tasks, reward, _ = _setup(args.config)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    model = engine.model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    # no reference model here: the KL term is not applied; the reference loop is fp32 with the textbook PPO clip
    loss_cfg = cfg.trainer.loss.model_copy(update={"off_policy": "ppo_clip"})
    sampling = SamplingParams(max_new_tokens=cfg.scheduler.max_tokens, temperature=cfg.scheduler.temperature)

    scorer = reasoning_gym.create_dataset(cfg.tasks.dataset, size=64, seed=42, **cfg.tasks.dataset_config)
    system = [{"role": "system", "content": cfg.tasks.system_prompt}] if cfg.tasks.system_prompt else []
    eval_sets = {
        "flywheel": [(t["prompt"], t["verifier"]["entry"]) for t in make_tasks(cfg.tasks) if t["split"] == "eval"],
        "seed42": [(system + [{"role": "user", "content": it["question"]}], it) for it in scorer],
    }

    def accuracy(items) -> str:
        greedy = SamplingParams(max_new_tokens=cfg.scheduler.max_tokens, temperature=0.0)
        out = engine.generate([GenerationRequest(encode_chat(tok, p), 1, greedy) for p, _ in items])
        right = neg = neg_right = 0
        for (_, entry), (s,) in zip(items, out):
            ok = reference_reward(scorer, tok.decode(s.completion_ids, skip_special_tokens=True), entry) == 1.0
            is_neg = str(entry["answer"]).startswith("-")
            right, neg, neg_right = right + ok, neg + is_neg, neg_right + (ok and is_neg)
        return f"{right / len(items):.3f} ({neg_right}/{neg} negative)"

    def evaluate(step: int) -> None:
        print(f"step {step} held-out accuracy: " + ", ".join(f"{k} {accuracy(v)}" for k, v in eval_sets.items()),
              flush=True)

    evaluate(0)
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch, prompts, samples = _generate(cfg, tok, engine, tasks, rng)
        rewards, resampled = [], 0
        for g, (t, p) in enumerate(zip(batch, prompts)):
            r = [reward(tok.decode(s.completion_ids, skip_special_tokens=True), t) for s in samples[g]]
            if args.resample_unsolved and max(r) == min(r) == 0.0:
                samples[g] = engine.generate([GenerationRequest(p, args.resample_unsolved, sampling)])[0]
                r = [reward(tok.decode(s.completion_ids, skip_special_tokens=True), t) for s in samples[g]]
                resampled += 1
            rewards.append(r)
        gn = plain_update(cfg, tok, model, opt, loss_cfg, prompts, samples, rewards)
        mean = sum(map(sum, rewards)) / sum(map(len, rewards))
        print(f"step {step}: {time.perf_counter() - t0:.1f} s, reward {mean:.3f}, grad norm {gn:.2f}, "
              f"re-sampled groups {resampled}", flush=True)
        if step % args.eval_every == 0:
            evaluate(step)
    print(f"training wall (evaluation included): {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
