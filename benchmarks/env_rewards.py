"""User environments' rewards through the verifier: rewards per second of a trivial Python reward (the
``environment`` kind, run in the environment's process pool) beside the built-in ``exact`` kind, same run.

    python benchmarks/env_rewards.py [--seconds 5] [--batch 64] [--workers 2] [--reward-batch-size 64]

Both are driven the way the service drives them: batches of ``--batch`` concurrent ``Scorer.score`` calls (the
service's ``max_batch`` records per poll), for ``--seconds``, alternating a right and a wrong answer. The
recipe is correctness alone (no truncation gate), so the figures compare the kinds' own cost. The environment's
calls reach its ``--workers`` processes at most ``--reward-batch-size`` per message (``verifier.reward_batch_size``;
1 = one round trip per call). Target on 2 cores: >= 5,000 rewards/s for the environment kind. Prints the CPU, a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pydantic import TypeAdapter  # noqa: E402

from shared.precision import cpu_features, cpu_model  # noqa: E402
from shared.verifier_specs import VerifierSpec  # noqa: E402
from verifier_service.config import VerifierConfig  # noqa: E402
from verifier_service.scorers import Scorer  # noqa: E402

ENV = '''
from flywheel.env import Environment


def exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


def load_environment():
    return Environment(dataset=[{"question": "q", "answer": "42"}], rubric=[exact])
'''
RECIPE = {"reason": "no truncation gate: the benchmark measures the kind alone"}


async def _rate(scorer: Scorer, spec, seconds: float, batch: int) -> tuple[float, int]:
    """Rewards per second over ``seconds`` of batches; the count of wrong scores (a broken benchmark)."""
    await asyncio.gather(*(scorer.score(spec, "42") for _ in range(batch)))  # warm: pools started
    done, bad, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        answers = ["42" if i % 2 == 0 else "41" for i in range(batch)]
        rewards = await asyncio.gather(*(scorer.score(spec, a) for a in answers))
        bad += sum(r.infra_error or r.total != float(a == "42") for r, a in zip(rewards, answers))
        done += batch
    return done / (time.perf_counter() - t0), bad


async def main(seconds: float, batch: int, workers: int, reward_batch_size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench_env.py"
        path.write_text(ENV)
        adapter = TypeAdapter(VerifierSpec)
        exact = adapter.validate_python({"kind": "exact", "answer": "42", "recipe": RECIPE})
        env = adapter.validate_python({"kind": "environment", "environment": {"path": str(path)}, "answer": "42",
                                       "recipe": RECIPE})
        scorer = Scorer(VerifierConfig(reward_workers=workers, reward_batch_size=reward_batch_size))
        try:
            exact_rate, exact_bad = await _rate(scorer, exact, seconds, batch)
            env_rate, env_bad = await _rate(scorer, env, seconds, batch)
        finally:
            await scorer.close()
    return {"cpu": cpu_model(), "features": cpu_features(), "batch": batch, "reward_workers": workers,
            "reward_batch_size": reward_batch_size,
            "exact_per_s": round(exact_rate), "environment_per_s": round(env_rate),
            "environment_vs_exact": round(env_rate / exact_rate, 3), "wrong_scores": exact_bad + env_bad,
            "target_environment_per_s": 5000}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reward-batch-size", type=int, default=VerifierConfig().reward_batch_size)
    a = ap.parse_args()
    out = asyncio.run(main(a.seconds, a.batch, a.workers, a.reward_batch_size))
    print(f"CPU: {out['cpu']} ({out['features']})")
    print(f"{'kind':<14}{'rewards/s':>12}")
    print(f"{'exact':<14}{out['exact_per_s']:>12,}")
    print(f"{'environment':<14}{out['environment_per_s']:>12,}   ({out['environment_vs_exact']}x of exact)")
    print(json.dumps(out))
