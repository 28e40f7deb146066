"""CPU per process of an idle system: the broker and the five services started as ``flywheel up`` starts them
(``flywheel.launcher.LocalSystem``), no task submitted, sampled over ``--seconds`` after ``--settle`` seconds
for the model loads.

Each arm is a set of ``--set``-style overrides on the config; the first arm is the baseline, measured in the
same run, so every figure stands beside it. Prints the CPU model (``/proc/cpuinfo``), then per arm each
process's share of one core (CPU seconds / wall seconds, user + system, ``/proc/<pid>/stat``) and the total.

    python benchmarks/idle_cpu.py --arms "kafka.fetch_max_wait_ms=20" "" --seconds 60
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.launcher import LocalSystem  # noqa: E402
from flywheel.service_env import overrides_to_env  # noqa: E402
from shared.precision import cpu_features, cpu_model  # noqa: E402


def measure(config: Path, sets: list[str], settle_s: float, seconds: float) -> dict[str, float]:
    """Share of one core per process (and ``total``) of an idle system with ``sets`` over ``seconds``."""
    with tempfile.TemporaryDirectory() as tmp:
        system = LocalSystem.start(config, Path(tmp) / "run", overrides_to_env(sets))
        try:
            time.sleep(settle_s)
            system.sample_rss()
            before, t0 = dict(system.cpu_seconds), time.monotonic()
            time.sleep(seconds)
            system.sample_rss()
            after, wall = system.cpu_seconds, time.monotonic() - t0
        finally:
            system.stop()
    share = {n: (after[n] - before.get(n, 0.0)) / wall for n in after}
    share["total"] = sum(share.values())
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic.yaml")
    ap.add_argument("--arms", nargs="+", default=[""],
                    help="each a space-separated list of section.field=value overrides; the first is the baseline")
    ap.add_argument("--settle", type=float, default=30.0, help="seconds after start before sampling")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds sampled")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()} [{cpu_features()}]; idle system of {args.config.name}, {args.seconds:.0f} s after {args.settle:.0f} s")
    results = {arm: measure(args.config, arm.split(), args.settle, args.seconds) for arm in args.arms}
    names = sorted({n for r in results.values() for n in r} - {"total"}) + ["total"]
    base = results[args.arms[0]]
    print("% of one core    " + "".join(f"{n:>11}" for n in names))
    for arm, r in results.items():
        print(f"{(arm or 'as configured')[:16]:<16} " + "".join(f"{100 * r.get(n, 0):>10.1f}%" for n in names))
        if arm != args.arms[0]:
            print(f"{'  vs baseline':<16} " + "".join(
                f"{(r.get(n, 0) / base[n] if base.get(n) else float('nan')):>10.2f}x" for n in names))


if __name__ == "__main__":
    main()
