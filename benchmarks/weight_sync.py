"""Weight broadcast throughput: SmolLM2-135M over gloo to 1 and 2 receiving processes, fp32 and bf16.

    python benchmarks/weight_sync.py [--repeats 3] [--bucket-mb 64]

For each dtype and receiver count, the trainer side (this process, rank 0) broadcasts the model's
weights as one session per repeat (``shared/weight_sync.py``: buckets, CRC-32 per bucket, a fresh
group per version); each receiver checks the checksums and rebuilds the tensors. Printed per case:
seconds per version (median), GB/s of weights delivered to each receiver, and the ratio to a plain
in-process copy of the same bytes (``torch.Tensor.copy_`` into preallocated buffers) measured in the
same run. Also printed: the checkpoint path for comparison (save_file + load of the same weights),
which is what a receiver does when it joins late or a session fails.

With ``--system-steps N`` (default 4; 0 skips it) it also runs the whole system (``flywheel run``,
SmolLM2 on the toy domain, all five services) once per transport and prints, from the rollout's log,
the seconds from a version's announcement to the first generation batch that uses it (median over
versions 2..N: version 1 can go out before the rollout engine registered for broadcasts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECEIVER = textwrap.dedent("""
    import os, sys, time, torch
    from safetensors.torch import load_file
    from shared.weight_sync import WeightReceiver
    port, rid, like_path, repeats, bucket, go = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    torch.set_num_threads(1)
    like = load_file(like_path)
    r = WeightReceiver("127.0.0.1", port, rid, timeout_s=120, bucket_bytes=bucket)
    open(go + "." + rid + ".ready", "w").close()
    for v in range(1, repeats + 1):
        while not os.path.exists(f"{go}.{v}"):
            time.sleep(0.001)
        got = r.receive(v, like)  # rank, world and bucket plan from the trainer's store
        assert got.keys() == like.keys()
    r.close()
""")


def _copy_seconds(tensors: dict, repeats: int) -> float:
    import torch

    dst = {k: torch.empty_like(t) for k, t in tensors.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, t in tensors.items():
            dst[k].copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _checkpoint_seconds(tensors: dict, tmp: Path) -> float:
    from safetensors.torch import load_file, save_file

    t0 = time.perf_counter()
    save_file(tensors, str(tmp / "w.safetensors"))
    load_file(str(tmp / "w.safetensors"))
    return time.perf_counter() - t0


def _case(tensors: dict, receivers: int, repeats: int, bucket: int, tmp: Path) -> dict:
    from safetensors.torch import save_file

    from flywheel.broker import free_port
    from shared.weight_sync import WeightBroadcaster

    like = tmp / "like.safetensors"
    save_file(tensors, str(like))
    port = free_port()
    bc = WeightBroadcaster("127.0.0.1", port, timeout_s=120, bucket_bytes=bucket)
    go = str(tmp / "go")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), f"r{i}", str(like), str(repeats),
                               str(bucket), go], env=env) for i in range(receivers)]
    try:
        while not all(os.path.exists(f"{go}.r{i}.ready") for i in range(receivers)):
            time.sleep(0.01)
        ids = bc.live_receivers()
        times = []
        for v in range(1, repeats + 1):
            Path(f"{go}.{v}").touch()
            res = bc.broadcast(v, tensors, ids)
            if not res["ok"]:
                raise RuntimeError(res["error"])
            times.append(res["seconds"])
        for p in procs:
            if p.wait(120) != 0:
                raise RuntimeError(f"receiver exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in tmp.glob("go*"):
            f.unlink()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sec = statistics.median(times)
    return {"seconds": round(sec, 3), "gb_per_s": round(nbytes / sec / 1e9, 3), "bytes": nbytes}


def _system_lag(transport: str, steps: int, tmp: Path) -> dict:
    """Run the toy system with SmolLM2 for ``steps`` steps; announcement → first generation, per version."""
    import re

    run_dir = tmp / f"sys-{transport}"
    cmd = [sys.executable, "-m", "flywheel.cli", "run", str(ROOT / "examples/toy.yaml"),
           "--set", "model.name=smollm2-135m-instruct", "--set", f"run.dir={run_dir}",
           "--set", f"budget.max_steps={steps}", "--set", f"weights.transport={transport}",
           "--set", "scheduler.eval_before_training=false", "--set", "trainer.micro_batch_size=8",
           "--set", "rollout.torch_threads=1", "--set", "trainer.torch_threads=1",
           "--report", str(tmp / f"{transport}.json"), "--timeout", "900"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200, cwd=tmp)
    rep = json.loads((tmp / f"{transport}.json").read_text())
    log = (Path(rep["run_dir"]) / "logs" / "rollout.log").read_text()
    lags = {int(v): float(s) for v, s in re.findall(r"policy version (\d+): ([\d.]+) s from its announcement", log)}
    how = dict(re.findall(r"loaded policy version (\d+) \((\w+)\)", log))
    later = [lag for v, lag in lags.items() if v >= 2]
    return {"lag_s_median": round(statistics.median(later), 3) if later else None,
            "lag_s": {v: round(x, 3) for v, x in sorted(lags.items())},
            "loaded_by": {int(v): h for v, h in how.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--system-steps", type=int, default=4)
    a = ap.parse_args()

    import torch

    from shared.model import load_model, resolve_model_dir

    torch.set_num_threads(1)
    from shared.config import ModelConfig

    model = load_model(resolve_model_dir(a.model, ModelConfig().cache_dir))
    base = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for dtype in (torch.float32, torch.bfloat16):
            tensors = {k: v.to(dtype).clone() for k, v in base.items()}
            copy_s = _copy_seconds(tensors, a.repeats)
            ckpt_s = _checkpoint_seconds(tensors, tmp)
            for n in (1, 2):
                r = _case(tensors, n, a.repeats, a.bucket_mb * 2**20, tmp)
                r["copy_seconds"] = round(copy_s, 4)
                r["ratio_to_copy"] = round(r["seconds"] / copy_s, 1)
                r["checkpoint_seconds"] = round(ckpt_s, 3)
                results[f"{str(dtype).split('.')[-1]}_x{n}"] = r
    print(f"\nweight broadcast over gloo, {a.model}, {a.bucket_mb} MiB buckets, median of {a.repeats}")
    print(f"{'case':<14}{'MB':>8}{'s/version':>11}{'GB/s':>8}{'copy s':>9}{'x copy':>8}{'ckpt s':>9}")
    for k, r in results.items():
        print(f"{k:<14}{r['bytes'] / 1e6:>8.0f}{r['seconds']:>11}{r['gb_per_s']:>8}{r['copy_seconds']:>9}"
              f"{r['ratio_to_copy']:>8}{r['checkpoint_seconds']:>9}")
    if a.system_steps:
        with tempfile.TemporaryDirectory() as d:
            for transport in ("checkpoint", "distributed"):
                results[f"system_{transport}"] = _system_lag(transport, a.system_steps, Path(d))
        print(f"\nrunning system (SmolLM2, toy domain, {a.system_steps} steps): announcement -> first generation")
        for transport in ("checkpoint", "distributed"):
            r = results[f"system_{transport}"]
            print(f"{transport:<14} median {r['lag_s_median']} s  per version {r['lag_s']}  loaded by {r['loaded_by']}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
