"""Toy runs that drop groups on purpose, each of which must reach ``max_steps``.

Every group the trainer drops (stale, failed, superseded without a re-sample) gives its slot in the
scheduler's issue budget back (flywheel.group_drops). This script runs ``examples/toy.yaml`` on a tiny
random model through the whole system (``flywheel run``) for each combination of max staleness η
(0, 1) and ``rollout.weight_update_policy`` (finish, interrupt), with 4 training tasks out of 20 whose
prompts exceed the model's context (failed groups, in every epoch) and 48 new tokens per sample (long
enough for interrupted generation to leave stale groups at η = 1), then prints per run: the steps
reached, the wall time (seconds) and the groups dropped per reason. Baseline for the counts: none;
the figure that matters is steps reached = ``--steps``.

    python benchmarks/runs_reach_max_steps.py --steps 200 [--oversample 1.25] [--keep]

With ``--oversample`` the scheduler issues more groups per step than the trainer takes
(``budget.oversample``): the surplus, mostly groups whose rewards are all equal, goes stale and is
dropped every step, at η = 0 and η = 1 alike.

Run directories go under a temporary folder and are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.model import build_tiny_model  # noqa: E402


def _long_tasks(path: Path, n: int) -> Path:
    """``n`` toy training tasks whose prompts (~3,000 digits) exceed the tiny model's 512 positions."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"task_id": f"long-{i}", "domain": "toy_prefix", "split": "train",
                                "prompt": [{"role": "user", "content": f"{i} " + "1234567890 " * 300}],
                                "verifier": {"kind": "regex", "pattern": "^[a-z]"}, "samples_per_task": 8}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--oversample", type=float, default=1.0, help="budget.oversample (> 1: stale drops)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flywheel-drops-"))
    tiny = build_tiny_model(work / "tiny")
    extra = _long_tasks(work / "long.jsonl", 4)
    rows = []
    try:
        for eta in (0, 1):
            for policy in ("finish", "interrupt"):
                name = f"eta{eta}-{policy}"
                report = work / f"{name}.json"
                t0 = time.monotonic()
                r = subprocess.run(
                    [sys.executable, "-m", "flywheel.cli", "run", str(ROOT / "examples/toy.yaml"),
                     "--set", f"model.name={tiny}", "--set", f"run.dir={work / name}",
                     "--set", f"budget.max_staleness={eta}", "--set", f"rollout.weight_update_policy={policy}",
                     "--set", "scheduler.max_tokens=48", "--set", "tasks.train_size=16",
                     "--set", f"budget.max_steps={args.steps}", "--set", "scheduler.eval_every=0",
                     "--set", f"budget.oversample={args.oversample}",
                     "--submit", str(extra), "--report", str(report), "--timeout", str(args.timeout)],
                    cwd=work, capture_output=True, text=True)
                wall = time.monotonic() - t0
                if r.returncode != 0 or not report.exists():
                    rows.append((name, "FAILED", wall, r.stderr[-400:].replace("\n", " ")))
                else:
                    rep = json.loads(report.read_text())
                    rows.append((name, rep["steps"], wall, rep.get("dropped_groups", {})))
                print(f"{name:16s} steps {rows[-1][1]}/{args.steps}  {wall:6.0f} s  dropped {rows[-1][3]}", flush=True)
                shutil.rmtree(work / name, ignore_errors=True) if not args.keep else None
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = all(r[1] == args.steps for r in rows)
    print(f"all runs reached {args.steps} steps: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
