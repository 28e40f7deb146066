"""Flywheel vs a plain single-process synchronous GRPO loop, same settings, same run.

Both use the settings of ``examples/arithmetic.yaml`` (SmolLM2-135M-Instruct, basic_arithmetic,
4 groups x 8 samples, 24 new tokens, lr 1e-5): the baseline generates, scores and trains in one
process with both cores (``torch.set_num_threads(2)``), one phase after the other; Flywheel runs
its five services over the embedded broker, generation overlapping training.

Prints wall seconds per trainer step for both (median over the steady steps, start-up and
evaluation excluded) and their ratio. Target: Flywheel <= 1.0x the baseline.

    python benchmarks/e2e_arithmetic.py --steps 8
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def baseline(config_path: Path, steps: int) -> list[float]:
    """Seconds per step of a synchronous generate → score → train loop in this process."""
    import random

    import reasoning_gym
    import torch

    from rollout_service.engine import GenerationRequest
    from rollout_service.torch_engine import TorchEngine
    from shared.config import load_config
    from shared.model import encode_chat, load_model, load_tokenizer, resolve_model_dir
    from shared.schemas import Reward, SamplingParams, ScoredTrajectory, Task, Trajectory, VersionSpan
    from shared.tasks import make_tasks
    from trainer_service.groups import Group
    from trainer_service.trainer import PolicyTrainer

    cfg = load_config(config_path)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.cache_dir)
    tok = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), tok, seed=0)
    trainer = PolicyTrainer(load_model(model_dir), cfg.trainer, tok.pad_token_id)
    trainer.model = engine.model  # one model: generation sees every update at once
    trainer.optimizer = torch.optim.AdamW(engine.model.parameters(), lr=cfg.trainer.lr)
    tasks = [Task(**t) for t in make_tasks(cfg.tasks) if t["split"] == "train"]
    ds = reasoning_gym.create_dataset(cfg.tasks.dataset, size=1, seed=0, **cfg.tasks.dataset_config)
    sp = SamplingParams(max_new_tokens=cfg.scheduler.max_tokens, temperature=cfg.scheduler.temperature)
    rng = random.Random(0)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = rng.sample(tasks, cfg.trainer.batch_groups)
        prompts = [encode_chat(tok, [m.model_dump() for m in t.prompt]) for t in batch]
        samples = engine.generate([GenerationRequest(p, t.samples_per_task, sp) for p, t in zip(prompts, batch)])
        groups = []
        for t, p, ss in zip(batch, prompts, samples):
            g = Group(t.task_id, len(ss))
            for i, s in enumerate(ss):
                text = tok.decode(s.completion_ids, skip_special_tokens=True)
                nums = re.findall(r"-?\d+", text.replace(",", ""))
                r = float(bool(nums) and ds.score_answer(nums[-1], t.verifier.entry) == 1.0)
                tr = Trajectory(trajectory_id=f"{t.task_id}:{i}", group_id=t.task_id, sample_index=i,
                                group_size=len(ss), task=t, prompt_ids=p, completion_ids=s.completion_ids,
                                completion_logprobs=s.logprobs, loss_mask=[1] * len(s.completion_ids),
                                completion_text=text, finish_reason=s.finish_reason,
                                policy_versions=[VersionSpan(version=step, start=0, end=len(s.completion_ids))])
                g.samples[i] = ScoredTrajectory(trajectory=tr, reward=Reward(total=r))
            groups.append(g)
        m = trainer.train_step(groups)
        times.append(time.perf_counter() - t0)
        print(f"baseline step {step + 1}: {times[-1]:.1f} s, reward {m['train/reward_mean']:.3f}", flush=True)
    return times


def flywheel(config_path: Path, steps: int) -> tuple[list[float], dict]:
    """Seconds between consecutive trainer steps of a ``flywheel run`` (from the metrics timestamps)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "shared.cli", "run", str(config_path), "--report", str(report),
               "--set", f"trainer.max_steps={steps}", "--set", "scheduler.eval_every=0",
               "--set", "tasks.eval_size=0", "--set", "scheduler.eval_before_training=false",
               "--set", f"run.dir={tmp}/runs"]
        subprocess.run(cmd, check=True, cwd=tmp)
        rep = json.loads(report.read_text())
    ts = [h["time"] for h in rep["history"]]
    return [b - a for a, b in zip(ts, ts[1:])], rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arithmetic.yaml")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    fw, rep = flywheel(args.config, args.steps)
    base = baseline(args.config, args.steps)
    base_steady = base[1:]  # the first step pays for lazy initialisation
    b, f = statistics.median(base_steady), statistics.median(fw)
    print(f"\nsingle-process synchronous loop: {b:.2f} s/step (median of {len(base_steady)} steps)")
    print(f"flywheel (5 services + broker):  {f:.2f} s/step (median of {len(fw)} step intervals)")
    print(f"ratio flywheel / single-process: {f / b:.2f}x (target <= 1.0x)")
    print(f"flywheel wall for {args.steps} steps incl. start-up and shutdown: {rep['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
