"""Flywheel vs a plain single-process synchronous GRPO loop, same settings, same run.

All three use the settings of ``examples/arithmetic.yaml`` (SmolLM2-135M-Instruct, basic_arithmetic,
4 groups x 8 samples, 24 new tokens, lr 1e-5, fp32) less its KL term and its re-samples of unsolved
groups, which the reference loop does not have (the KL term costs a reference forward and trains
zero-advantage rows too):

- **plain loop** (the baseline of the target): the textbook synchronous loop in one process with
  both cores (``torch.set_num_threads(2)``): ``generate`` → score → one forward of every
  prompt + completion (left-padded prompts, as TRL lays them out; only the completion positions
  go through the output layer, ``logits_to_keep``) → GRPO loss → AdamW. This is what the
  reference measurement in the issue ran (~14.7 s per step there).
- **Flywheel's trainer in one process**: the same synchronous loop, but with Flywheel's own
  trainer (one prompt pass per group, only completion positions through the output layer, rows of
  zero advantage skipped). It shows what the services' overlap adds beyond those kernels.
- **Flywheel**: ``flywheel run`` with its five services over the embedded broker, generation
  overlapping training (one core each).

The bf16 arms: the plain loop under ``torch.autocast(bfloat16)`` (what a user would do by
hand on this CPU), and ``flywheel run`` with bf16 generation (``rollout.dtype: bfloat16``), bf16-autocast
training with fp32 master weights and AdamW (``trainer.autocast_bf16``) and the decoupled clip against the
trainer's own log-probs (``trainer.loss.off_policy: decoupled``: the mismatch correction), with and without
the main job's KL term (a bf16 reference model).

Prints wall seconds per trainer step for each arm (the mean over the steady steps: start-up and
evaluation excluded; the median beside it), every arm measured in this one run, and the ratios of the
means against the baselines with the baseline's own figure beside each. The mean, not the median: with
staleness 1 a pipelined run's intervals alternate (a step that found its data ready, then one that
waited: 1.8, 5.6, 1.9, 5.2 s), so their median can land on either mode (3.4 or 5.4 s for the same
throughput); the mean interval is steps per wall second, what a run takes. The loops' steps are
sequential and even, so their mean and median agree. Targets: Flywheel fp32 <= 1.0x the plain loop; Flywheel bf16
<= 0.35x the fp32 plain loop and <= 0.7x the bf16-autocast plain loop.

    python benchmarks/e2e_arithmetic.py --steps 8 [--arms plain plain_bf16 flywheel_bf16 ...]
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


def reference_reward(ds, text: str, entry: dict) -> float:
    """The reference reward: 1.0 when the last integer of ``text`` (commas removed) makes the
    reasoning-gym dataset ``ds`` score ``entry`` exactly 1.0, else 0.0."""
    nums = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(nums) and ds.score_answer(nums[-1], entry) == 1.0)


def _setup(config_path: Path):
    import random

    import reasoning_gym
    import torch

    from rollout_service.torch_engine import TorchEngine
    from flywheel.config import load_config
    from shared.model import load_model, load_tokenizer, resolve_model_dir
    from shared.schemas import Task
    from flywheel.tasks import make_tasks

    cfg = load_config(config_path)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.cache_dir)
    tok = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), tok, seed=0)
    tasks = [Task(**t) for t in make_tasks(cfg.tasks) if t["split"] == "train"]
    ds = reasoning_gym.create_dataset(cfg.tasks.dataset, size=1, seed=0, **cfg.tasks.dataset_config)

    def reward(text: str, task) -> float:
        return reference_reward(ds, text, task.verifier.entry)

    return cfg, tok, engine, tasks, reward, random.Random(0)


def _generate(cfg, tok, engine, tasks, rng):
    from rollout_service.engine import GenerationRequest
    from shared.model import encode_chat
    from shared.schemas import SamplingParams

    sp = SamplingParams(max_new_tokens=cfg.scheduler.max_tokens, temperature=cfg.scheduler.temperature)
    batch = rng.sample(tasks, cfg.budget.batch_groups)
    prompts = [encode_chat(tok, [m.model_dump() for m in t.prompt]) for t in batch]
    return batch, prompts, engine.generate([GenerationRequest(p, t.samples_per_task, sp) for p, t in zip(prompts, batch)])


def plain_update(cfg, tok, model, opt, loss_cfg, prompts: list[list[int]], samples: list[list],
                 rewards: list[list[float]]) -> float:
    """One GRPO update of the plain loop on groups of any sizes; returns the gradient norm.

    ``prompts[g]`` are the token ids of group g's prompt, ``samples[g]`` its generated samples
    (``completion_ids``, ``logprobs``) and ``rewards[g]`` their rewards. Advantages are normalised
    per group (``group_advantages``); the loss is Flywheel's ``grpo_loss`` over one forward of every
    prompt + completion.
    """
    import torch

    from trainer_service.losses.advantages import group_advantages
    from trainer_service.losses.grpo import grpo_loss

    prompts_rows, comps, blps = [], [], []
    for p, ss in zip(prompts, samples):
        for s in ss:
            prompts_rows.append(p)
            comps.append(s.completion_ids)
            blps.append(s.logprobs)
    adv = torch.cat([group_advantages(torch.tensor([r], dtype=torch.float64), "grpo", loss_cfg.adv_eps).flatten()
                     for r in rewards]).float()
    # left-padded prompts then right-padded completions (as TRL lays them out): every completion
    # starts at column P, and only the last T + 1 positions go through the output layer
    B, P, T = len(comps), max(map(len, prompts_rows)), max(1, max(map(len, comps)))
    ids = torch.full((B, P + T), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    blp = torch.zeros(B, T)
    mask = torch.zeros(B, T)
    for i, (pr, c) in enumerate(zip(prompts_rows, comps)):
        ids[i, P - len(pr):P] = torch.tensor(pr)
        attn[i, P - len(pr):P] = 1
        if c:
            ids[i, P:P + len(c)] = torch.tensor(c)
            attn[i, P:P + len(c)] = 1
            blp[i, :len(c)] = torch.tensor(blps[i])
            mask[i, :len(c)] = 1
    model.train()
    opt.zero_grad()
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=T + 1).logits[:, :-1]
    lp = torch.log_softmax(logits.float() / cfg.scheduler.temperature, -1).gather(-1, ids[:, P:, None])[..., 0]
    norm = mask.sum().clamp(min=1) if loss_cfg.loss_agg == "token_mean" else float(B)
    loss, _ = grpo_loss(lp, blp, adv, mask, float(norm), loss_cfg)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm)
    opt.step()
    model.eval()
    return float(gn)


def plain_loop(config_path: Path, steps: int, bf16: bool = False) -> list[float]:
    """Seconds per step of a textbook synchronous generate → score → full-forward GRPO update loop.

    ``bf16``: what a user would do by hand on this CPU: fp32 weights and AdamW, generation and the update's
    forward/backward under ``torch.autocast("cpu", torch.bfloat16)`` (the loss against the log-probs that
    generation recorded, as the fp32 loop does)."""
    import contextlib

    import torch

    cfg, tok, engine, tasks, reward, rng = _setup(config_path)
    model = engine.model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    loss_cfg = cfg.trainer.loss.model_copy(update={"off_policy": "ppo_clip"})  # the textbook PPO clip
    name = "plain loop (bf16 autocast)" if bf16 else "plain loop"
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            batch, prompts, samples = _generate(cfg, tok, engine, tasks, rng)
            rewards = [[reward(tok.decode(s.completion_ids, skip_special_tokens=True), t) for s in ss]
                       for t, ss in zip(batch, samples)]
            plain_update(cfg, tok, model, opt, loss_cfg, prompts, samples, rewards)
        times.append(time.perf_counter() - t0)
        print(f"{name} step {step + 1}: {times[-1]:.1f} s, reward {float(torch.tensor(rewards).mean()):.3f}",
              flush=True)
    return times


def as_groups(cfg, tok, batch, prompts, samples, rewards: list[list[float]], version: int) -> list:
    """The trainer's :class:`Group` of each task of ``batch`` from its generated ``samples`` (behaviour policy
    ``version``, loss mask all ones) and their ``rewards``."""
    from shared.schemas import Reward, ScoredTrajectory, Trajectory, VersionSpan
    from trainer_service.groups import Group

    groups = []
    for t, p, ss, rs in zip(batch, prompts, samples, rewards):
        g = Group(t.task_id, len(ss))
        for i, (s, r) in enumerate(zip(ss, rs)):
            tr = Trajectory(trajectory_id=f"{t.task_id}:{i}", group_id=t.task_id, sample_index=i,
                            group_size=len(ss), task=t, prompt_ids=p, completion_ids=s.completion_ids,
                            completion_logprobs=s.logprobs, loss_mask=[1] * len(s.completion_ids),
                            completion_text=tok.decode(s.completion_ids, skip_special_tokens=True),
                            finish_reason=s.finish_reason, temperature=cfg.scheduler.temperature,
                            policy_versions=[VersionSpan(version=version, start=0, end=len(s.completion_ids))])
            g.samples[i] = ScoredTrajectory(trajectory=tr, reward=Reward(total=r))
        groups.append(g)
    return groups


def flywheel_trainer_loop(config_path: Path, steps: int) -> list[float]:
    """Seconds per step of the same synchronous loop with Flywheel's PolicyTrainer doing the update."""
    from trainer_service.trainer import PolicyTrainer

    cfg, tok, engine, tasks, reward, rng = _setup(config_path)
    # one model: generation sees each update; no KL term and fp32, as in the plain loop
    fp32 = {"kl_coef": 0.0, "autocast_bf16": False, "output_bf16": False,
            "loss": cfg.trainer.loss.model_copy(update={"off_policy": "ppo_clip"})}
    trainer = PolicyTrainer(engine.model, cfg.trainer.model_copy(update=fp32), tok.pad_token_id)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch, prompts, samples = _generate(cfg, tok, engine, tasks, rng)
        rewards = [[reward(tok.decode(s.completion_ids, skip_special_tokens=True), t) for s in ss]
                   for t, ss in zip(batch, samples)]
        groups = as_groups(cfg, tok, batch, prompts, samples, rewards, step)
        m = trainer.train_step(groups)
        times.append(time.perf_counter() - t0)
        print(f"flywheel-trainer loop step {step + 1}: {times[-1]:.1f} s, reward {m['train/reward_mean']:.3f}",
              flush=True)
    return times


PRECISION = {
    "fp32": ["rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.output_bf16=false",
             "trainer.loss.off_policy=ppo_clip"],
    "bf16": ["rollout.dtype=bfloat16", "trainer.autocast_bf16=true", "trainer.output_bf16=true",
             "trainer.loss.off_policy=decoupled"],
}
"""The ``--set`` overrides of each precision: fp32 everywhere (the PPO clip against the behaviour policy), or
bf16 generation and bf16 training (body under autocast, output layer's matmuls in bf16) with the decoupled clip
against the trainer's own log-probs."""


def flywheel(config_path: Path, steps: int, precision: str = "fp32", kl: bool = False,
             extra: list[str] = ()) -> tuple[list[float], dict]:
    """Seconds between consecutive trainer steps of a ``flywheel run`` (from the metrics timestamps).

    ``precision``: a key of :data:`PRECISION`; ``kl``: keep the config's KL term (the main job's settings),
    else ``trainer.kl_coef=0`` like the reference loop."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "flywheel.cli", "run", str(config_path), "--report", str(report),
               "--set", f"budget.max_steps={steps}", "--set", "scheduler.eval_every=0",
               "--set", "budget.oversample=1.0",  # the loops generate exactly B groups per step
               "--set", "budget.resample_unsolved=0",  # ... and no extra groups for unsolved ones
               "--set", "tasks.eval_size=0", "--set", "scheduler.eval_before_training=false",
               "--set", f"run.dir={tmp}/runs"]
        if not kl:
            cmd += ["--set", "trainer.kl_coef=0"]  # the reference loop has no KL term (no reference forward)
        for kv in [*PRECISION[precision], *extra]:
            cmd += ["--set", kv]
        subprocess.run(cmd, check=True, cwd=tmp)
        rep = json.loads(report.read_text())
    ts = [h["time"] for h in rep["history"]]
    return [b - a for a, b in zip(ts, ts[1:])], rep


ARMS = ("plain", "plain_bf16", "own", "flywheel", "flywheel_bf16", "flywheel_kl", "flywheel_bf16_kl")
"""Every arm: the plain loop in fp32 and with bf16 autocast, the loop with Flywheel's trainer (fp32), and
``flywheel run`` in fp32 and bf16, without and with the main job's KL term."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arithmetic.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra config override for the flywheel arms (e.g. kafka.fetch_max_wait_ms=100)")
    args = ap.parse_args()
    from shared.precision import probe_bf16

    support = probe_bf16()
    best = "bf16" if support.native else "fp32"  # what `auto` picks here: the ratio that counts on this machine
    print(f"best dtype on this machine: {best} ({support.reason})", flush=True)
    sec: dict[str, float] = {}
    """Mean seconds per step over the steady steps."""
    med: dict[str, float] = {}
    walls: dict[str, float] = {}
    for arm in args.arms:  # every arm in this one run, one after another on the quiet machine
        if arm.startswith("flywheel"):
            fw, rep = flywheel(args.config, args.steps, "bf16" if "bf16" in arm else "fp32", kl=arm.endswith("_kl"),
                               extra=args.set)
            intervals, walls[arm] = fw, rep["wall_seconds"]
        elif arm == "own":
            intervals = flywheel_trainer_loop(args.config, args.steps)[1:]
        else:  # the first step pays for lazy initialisation
            intervals = plain_loop(args.config, args.steps, bf16=arm == "plain_bf16")[1:]
        sec[arm], med[arm] = statistics.mean(intervals), statistics.median(intervals)
    label = {"plain": "plain single-process loop, fp32", "plain_bf16": "plain loop, bf16 autocast",
             "own": "single-process loop, Flywheel's trainer, fp32", "flywheel": "flywheel, fp32, no KL",
             "flywheel_bf16": "flywheel, bf16 + decoupled, no KL", "flywheel_kl": "flywheel, fp32, KL on (main job)",
             "flywheel_bf16_kl": "flywheel, bf16 + decoupled, KL on (main job)"}
    print()
    for arm, v in sec.items():
        extra = f", wall {walls[arm]:.0f} s for {args.steps} steps incl. start-up" if arm in walls else ""
        print(f"{label[arm]:<48} {v:6.2f} s/step (median {med[arm]:.2f}){extra}")
    for arm in [a for a in sec if a.startswith("flywheel")]:
        for base, target in (("plain", 0.35 if "bf16" in arm else 1.0), ("plain_bf16", 0.7)):
            if base in sec and not (base == "plain_bf16" and "bf16" not in arm):
                print(f"ratio {arm} / {base}: {sec[arm] / sec[base]:.2f}x (baseline {sec[base]:.2f} s/step"
                      f"{', target <= %.2fx' % target if not arm.endswith('_kl') else ''})")


    plain_best, fly_best = ("plain_bf16", "flywheel_bf16") if best == "bf16" else ("plain", "flywheel")
    if plain_best in sec and fly_best in sec:
        print(f"best dtype ({best}): {fly_best} / {plain_best}: {sec[fly_best] / sec[plain_best]:.2f}x "
              f"(baseline {sec[plain_best]:.2f} s/step, target <= 0.50x)")


if __name__ == "__main__":
    main()
