"""What writing a checkpoint every policy version costs the machine: buffered vs direct I/O.

    python benchmarks/checkpoint_io.py [--versions 10] [--params 135] [--keep 2] [--dir /tmp/flywheel-ckpt-io]

Writes ``--versions`` versions the way :class:`shared.checkpoint.CheckpointStore` does for a model of
``--params`` million fp32 parameters (SmolLM2-135M: 540 MB of weights through safetensors, then 1.08 GB of
AdamW moments through ``torch.save``), deleting the version ``--keep`` back after each, once with the
optimizer state written through the page cache (``open``, what the store did before) and once through
:class:`shared.disk.DirectFile` (``O_DIRECT``). Both arms in one run, baseline first.

Printed per arm: wall seconds per version, this process's user and system CPU seconds per version, and the
whole machine's busy CPU seconds per version (``/proc/stat``: kernel writeback and reclaim run in kernel
threads, outside the writer's own account). On a 2-core machine where a trainer step takes ~5 s, each
CPU-second per version is a tenth of the machine. Run it on a quiet machine; it needs ~2 GB free on
``--dir``'s file system and deletes what it wrote.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.disk import DirectFile  # noqa: E402


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat``: all but idle and iowait)."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def run_arm(root: Path, direct: bool, versions: int, keep: int, weights: dict, optimizer: dict) -> dict[str, float]:
    """Write ``versions`` versions under ``root``; returns seconds per version (wall, user, sys, machine)."""
    root.mkdir(parents=True, exist_ok=True)
    t0, m0, r0 = time.perf_counter(), _machine_busy_s(), os.times()
    for v in range(versions):
        d = root / f"v{v:06d}"
        d.mkdir()
        save_file(weights, str(d / "model.safetensors"))
        with (DirectFile(d / "optimizer.pt") if direct else open(d / "optimizer.pt", "wb")) as f:
            torch.save(optimizer, f)
        if v >= keep:
            shutil.rmtree(root / f"v{v - keep:06d}")
    wall, machine, r1 = time.perf_counter() - t0, _machine_busy_s() - m0, os.times()
    shutil.rmtree(root)
    return {"wall": wall / versions, "user": (r1.user - r0.user) / versions,
            "sys": (r1.system - r0.system) / versions, "machine": machine / versions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--params", type=float, default=135.0, help="millions of fp32 parameters")
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/flywheel-ckpt-io"))
    args = ap.parse_args()
    n_tensors = 27
    per = int(args.params * 1e6 / n_tensors)
    weights = {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors)}
    optimizer = {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(per), "exp_avg_sq": torch.randn(per)}
                           for i in range(n_tensors)}, "param_groups": [{"lr": 1e-5, "params": list(range(n_tensors))}]}
    gb = 12 * per * n_tensors / 1e9
    print(f"{args.versions} versions of {args.params:g}M fp32 parameters ({gb:.2f} GB written per version: weights "
          f"+ AdamW moments), keeping {args.keep}, on {args.dir}")
    res = {}
    for name, direct in (("buffered (baseline)", False), ("direct", True)):
        res[name] = r = run_arm(args.dir, direct, args.versions, args.keep, weights, optimizer)
        print(f"  optimizer state {name:<20} {r['wall']:5.2f} s wall, process {r['user']:4.2f} user + {r['sys']:4.2f} "
              f"sys, machine busy {r['machine']:4.2f} CPU-s per version", flush=True)
    base, new = res["buffered (baseline)"], res["direct"]
    print(f"direct / buffered: machine CPU {new['machine'] / base['machine']:.2f}x ({new['machine']:.2f} vs "
          f"{base['machine']:.2f} CPU-s per version), wall {new['wall'] / base['wall']:.2f}x")


if __name__ == "__main__":
    main()
