"""What metrics and tracing cost the main job: seconds per trainer step with telemetry on and off, same run.

    python benchmarks/telemetry_overhead.py [--steps 6] [--rounds 1] [--config examples/arithmetic.yaml]

Runs the main job (``flywheel run``, SmolLM2 on ``basic_arithmetic``, the embedded broker and the five
services) ``--rounds`` times per arm, the arms alternating (on, off, on, off...) so a drift in the
machine's load hits both:

- **on**: the defaults. Every service serves Prometheus metrics, and spans go to the local SQLite span
  store (``telemetry.traces: auto`` = ``local``).
- **off**: ``telemetry.metrics=false`` and ``telemetry.traces=off`` (spans are still created by the
  OpenTelemetry API but recorded nowhere; no metrics server).

Each run has ``--steps`` steps, no held-out evaluation (``scheduler.eval_before_training=false``,
``tasks.eval_size=0``) and the same seed. Seconds per step are taken from the trainer's Metrics records
in the run report. The figure is the median gap between consecutive steps after the first step, which
holds the warm-up and the first batch's wait. Printed: each run's figure, the median per arm, and the ratio
on / off. The run directories are deleted afterwards (each holds checkpoints with optimizer state).
Run it on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"on": [], "off": ["telemetry.metrics=false", "telemetry.traces=off"]}


def seconds_per_step(report: dict) -> tuple[float, int]:
    """Median seconds between consecutive trainer steps after step 1, and how many gaps it is over.

    Raises:
        ValueError: fewer than 3 steps in the report's history.
    """
    times = sorted((h["step"], h["time"]) for h in report["history"] if h.get("step"))
    times = [t for s, t in times if s >= 1]
    if len(times) < 3:
        raise ValueError(f"need at least 3 steps, the report has {len(times)}")
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return statistics.median(gaps), len(gaps)


def run_once(config: Path, steps: int, arm: str, work: Path, timeout_s: float) -> dict:
    """One ``flywheel run`` of ``steps`` steps in arm ``arm``; returns its figures (the run dir is deleted)."""
    run_dir, report = work / f"run-{arm}-{time.time_ns()}", work / f"{arm}-{time.time_ns()}.json"
    sets = [f"budget.max_steps={steps}", "scheduler.eval_before_training=false", "tasks.eval_size=0", *ARMS[arm]]
    cmd = [sys.executable, "-m", "flywheel.cli", "run", str(config), "--report", str(report), "--run-dir",
           str(run_dir), "--timeout", str(timeout_s)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout_s + 120)
        if r.returncode != 0:
            raise RuntimeError(f"{arm}: flywheel run exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        rep = json.loads(report.read_text())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    sps, gaps = seconds_per_step(rep)
    return {"arm": arm, "seconds_per_step": sps, "gaps": gaps, "wall_s": time.monotonic() - t0,
            "steps": rep["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arithmetic.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="telemetry-overhead-") as tmp:
        for i in range(args.rounds):
            for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
                res = run_once(args.config.resolve(), args.steps, arm, Path(tmp), args.timeout)
                results.append(res)
                print(f"round {i + 1} {arm:>3}: {res['seconds_per_step']:.2f} s/step (median of {res['gaps']} gaps), "
                      f"{res['steps']} steps, run {res['wall_s']:.0f} s", flush=True)
    med = {arm: statistics.median(r["seconds_per_step"] for r in results if r["arm"] == arm) for arm in ARMS}
    print(f"telemetry off (baseline): {med['off']:.2f} s/step")
    print(f"telemetry on:             {med['on']:.2f} s/step")
    print(f"ratio on/off:             {med['on'] / med['off']:.3f}x")


if __name__ == "__main__":
    main()
