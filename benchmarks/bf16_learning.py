"""Learning per step in bf16 against fp32: the main job (``examples/arithmetic.yaml``, README's first command)
over several seeds in each precision, held-out greedy accuracy side by side (issue 20).

Precisions (``benchmarks/e2e_arithmetic.py``'s :data:`PRECISION`):

- ``fp32``: fp32 generation and training, the PPO clip against the behaviour log-probs;
- ``bf16``: bf16 generation (``rollout.dtype: bfloat16``), bf16-autocast training with fp32 master weights
  and AdamW and a bf16 reference model (``trainer.autocast_bf16``), the decoupled clip against the
  trainer's own log-probs with the truncated importance weight against the behaviour policy
  (``trainer.loss.off_policy: decoupled``: the mismatch correction).

A seed sets ``scheduler.seed``, ``rollout.seed`` and ``trainer.seed``. Each run's report is kept under
``--out`` (``<precision>-s<seed>.json``); runs already there are not run again, so the comparison can be
built over several invocations. Prints accuracy at steps 0, 10, 20 and 30 for every run, each precision's
mean, the difference of the means (target: within 0.05 at 10, 20 and 30), and wall seconds and the
run's median trainer-step seconds beside them.

    python benchmarks/bf16_learning.py --seeds 0 1 2 --precisions fp32 bf16 --out runs/bf16_learning
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e_arithmetic import PRECISION  # noqa: E402

STEPS = (0, 10, 20, 30)


def run_one(config: Path, precision: str, seed: int, report: Path) -> dict:
    """One main-job ``flywheel run`` in ``precision`` with ``seed``; its report (also written to ``report``).
    The run directory (checkpoints: about 2 GB) lives in a temporary directory, deleted afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "flywheel.cli", "run", str(config), "--report", str(report),
               "--set", f"run.dir={tmp}/runs"]
        for kv in (*PRECISION[precision], f"scheduler.seed={seed}", f"rollout.seed={seed}", f"trainer.seed={seed}"):
            cmd += ["--set", kv]
        subprocess.run(cmd, check=True, cwd=tmp)
    return json.loads(report.read_text())


def accuracy_at(report: dict, step: int) -> float | None:
    """Held-out accuracy of the eval round of policy version ``step`` (None if the run has none)."""
    for e in report.get("evals", []):
        if e.get("policy_version") == step and e.get("accuracy") is not None:
            return float(e["accuracy"])
    return None


def step_seconds(report: dict) -> float | None:
    """Median seconds between consecutive trainer steps (from the history's timestamps)."""
    ts = [h["time"] for h in report.get("history", []) if "time" in h]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def mean_of(report: dict, key: str) -> float | None:
    """Mean of metric ``key`` over the run's trainer steps that report it (None if none does)."""
    vals = [h[key] for h in report.get("history", []) if h.get(key) is not None]
    return statistics.mean(vals) if vals else None


SIGNALS = ("mismatch/onpolicy_abs_logp_diff", "mismatch/onpolicy_k3", "mismatch/abs_logp_diff", "loss/clip_frac",
           "loss/is_truncated_frac", "time/train_step_s")
"""Per-step metrics whose run means are printed for each run: the training-inference mismatch on policy
(numerics alone) and over all tokens, the clipped fraction, the truncated IS fraction, the train step (s)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arithmetic.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--precisions", nargs="+", choices=sorted(PRECISION), default=["fp32", "bf16"])
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bf16_learning")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    reports: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        for precision in args.precisions:
            path = args.out / f"{precision}-s{seed}.json"
            reports[precision, seed] = (json.loads(path.read_text()) if path.exists()
                                        else run_one(args.config.resolve(), precision, seed, path))
    print("\nheld-out greedy accuracy (64 items) by trainer step")
    print(f"{'run':<12}" + "".join(f"{'step ' + str(s):>9}" for s in STEPS) + f"{'wall s':>9}{'s/step':>9}")
    means: dict[str, list[float | None]] = {}
    for precision in args.precisions:
        rows = [reports[precision, s] for s in args.seeds]
        for seed, rep in zip(args.seeds, rows):
            accs = [accuracy_at(rep, s) for s in STEPS]
            sps = step_seconds(rep)
            print(f"{precision + ' s' + str(seed):<12}" + "".join(f"{a:>9.3f}" if a is not None else f"{'-':>9}"
                                                                  for a in accs)
                  + f"{rep.get('wall_seconds', float('nan')):>9.0f}" + (f"{sps:>9.1f}" if sps else f"{'-':>9}"))
        col = []
        for s in STEPS:
            vals = [a for a in (accuracy_at(r, s) for r in rows) if a is not None]
            col.append(statistics.mean(vals) if vals else None)
        means[precision] = col
        print(f"{precision + ' mean':<12}" + "".join(f"{a:>9.3f}" if a is not None else f"{'-':>9}" for a in col))
    print("\nrun means per trainer step: " + ", ".join(SIGNALS))
    for (precision, seed), rep in reports.items():
        vals = [mean_of(rep, k) for k in SIGNALS]
        print(f"{precision + ' s' + str(seed):<12}" + "".join(f"{v:>12.4f}" if v is not None else f"{'-':>12}"
                                                              for v in vals))
    if "fp32" in means and "bf16" in means:
        diffs = [(b - f) if b is not None and f is not None else None for b, f in zip(means["bf16"], means["fp32"])]
        print(f"{'bf16 - fp32':<12}" + "".join(f"{d:>+9.3f}" if d is not None else f"{'-':>9}" for d in diffs)
              + "   (target: |difference| <= 0.05 at steps 10, 20, 30)")
        for precision in ("fp32", "bf16"):
            rss = [max((reports[precision, s].get("peak_rss_bytes") or {}).get(n, 0) for s in args.seeds)
                   for n in ("trainer", "rollout")]
            print(f"{precision}: peak RSS trainer {rss[0] / 2**20:.0f} MiB, rollout {rss[1] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
