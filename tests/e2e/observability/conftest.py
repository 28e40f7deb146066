"""One live toy system shared by the observability tests (metrics, traces, dashboard, analytics, schemas).

The package-scoped fixture :func:`observed` starts the embedded broker and the five services once
(``flywheel.launcher.LocalSystem``) with a tiny random model and two domains:

- ``toy``: a regex on 4 tokens (learned in seconds), K = 4;
- ``code``: one-line Python functions checked by unit tests in the sandbox, K = 2 (so groups pass
  through the sandbox and its spans and metrics exist).

It submits the tasks, runs an eval round before training, waits until the trainer has published
:data:`MIN_VERSION` policy versions and a second eval round is done, then hands the running system to the
tests. Every test of the package uses the same system; it is stopped (every process by its id) after the
package's last test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from flywheel.cli.client import submit_tasks
from flywheel.launcher import LocalSystem
from scheduler_service.config import RUN_SIGNALS, SIGNALS
from shared.auth import auth_headers, token_from_run_dir
from shared.model import build_tiny_model

OPT_OUT = {"reason": "no truncation gate: the token budgets here are a few tokens by design, so most completions hit them"}
"""The verifier recipe of these tasks: an explicit opt-out of the verifier's default truncation gate."""


DOMAIN_SIGNALS = [s for s in SIGNALS if s not in RUN_SIGNALS]
MIN_VERSION = 3
"""Policy versions the trainer must have published before the tests look."""
TOY_K, CODE_K = 4, 2


@dataclass
class Observed:
    """The running system and what the fixture did to it."""

    system: LocalSystem
    run_dir: Path
    url: str
    """The scheduler's base URL."""
    eval_rounds: list[int]


def _config(model_dir: Path, runs: Path) -> dict:
    keep = {"retire_after": 0, "flag_after": 0}
    return {
        "model": {"name": str(model_dir)},
        "run": {"dir": str(runs)},
        "domains": {"toy": {"weight": 1.0, "samples_per_task": TOY_K, "max_tokens": 4, "lifecycle": keep},
                    "code": {"weight": 1.0, "samples_per_task": CODE_K, "max_tokens": 16, "lifecycle": keep}},
        "budget": {"batch_groups": 4, "max_staleness": 1, "max_steps": 100_000},
        "scheduler": {"max_tokens": 4, "temperature": 1.0, "eval_before_training": False},
        "rollout": {"engine": "torch", "max_batch_samples": 32, "max_trajectory_tokens": 200},
        "sandbox": {"max_concurrency": 2},
        # the monitor stays on (its gauges and warning alerts are observed), but no signal turns critical: a
        # tripped breaker stops a domain's groups and leaves none to trace or chart. The tiny model drifts
        # for real: it answers a code prompt the same way K = 2 times over (diversity_collapse), learns the
        # toy regex within minutes (pass_rate_jump), and a loaded machine times out sandbox runs
        # (infra_error_rate, scorer_inconsistency); in CI the code domain stopped that way mid-package
        "monitor": {"enabled": True, "signals": {**{s: {"critical": None} for s in DOMAIN_SIGNALS},
                                                 "diversity_collapse": {"enabled": False}}},
        "trainer": {"loss": "bnpo", "truncation": "keep", "lr": 3.0e-3, "micro_batch_size": 32,
                    "keep_checkpoints": 1},
    }


def _tasks() -> list[dict]:
    out = []
    for split, n in (("train", 24), ("eval", 8)):
        for i in range(n):
            out.append({"task_id": f"toy-{split}-{i}", "domain": "toy", "split": split,
                        "prompt": [{"role": "user", "content": f"write a word {split} {i}"}],
                        "samples_per_task": TOY_K,
                        "verifier": {"kind": "regex", "pattern": "^[a-z]", "recipe": OPT_OUT}})
            test = {"name": f"t{i}", "code": f"assert f({i}) == {i + 1}"}
            out.append({"task_id": f"code-{split}-{i}", "domain": "code", "split": split,
                        "prompt": [{"role": "user", "content": f"Write f(x) returning x + 1. ({split} {i})"}],
                        "samples_per_task": CODE_K,
                        "verifier": {"kind": "unit_tests", "entry_point": "f", "tests": [test], "recipe": OPT_OUT}})
    return out


def _eval_round(url: str, token: str | None) -> int:
    r = httpx.post(f"{url}/v1/evals", json={}, headers=auth_headers(token), timeout=30)
    r.raise_for_status()
    return r.json()["eval_round"]


def _wait(cond, timeout_s: float, system: LocalSystem, what: str, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        system.check()
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s\n" +
                               "\n".join(f"--- {n}\n{sp.tail(20)}" for n, sp in system.services.items()))
        time.sleep(every_s)


def _status(url: str) -> dict:
    return httpx.get(f"{url}/v1/status", timeout=30).json()


def _eval_done(url: str, rid: int) -> bool:
    return bool(httpx.get(f"{url}/v1/evals/{rid}", timeout=30).json().get("done"))


@pytest.fixture(scope="package")
def observed(tmp_path_factory) -> Observed:
    """The running toy system (see the module docstring); stopped after the package's last test."""
    root = tmp_path_factory.mktemp("observed")
    model_dir = build_tiny_model(root / "tiny")
    cfg = root / "system.yaml"
    cfg.write_text(yaml.safe_dump(_config(model_dir, root / "runs")))
    system = LocalSystem.start(cfg, root / "run", timeout_s=240)
    try:
        url = system.scheduler_url
        token = token_from_run_dir(system.run_dir)  # the system's token: the mutating routes want it
        submit_tasks(url, _tasks(), token=token)
        rounds = [_eval_round(url, token)]
        _wait(lambda: _eval_done(url, rounds[0]), 300, system, "the first eval round")
        _wait(lambda: (_status(url).get("policy_version") or 0) >= MIN_VERSION, 400, system,
              f"policy version {MIN_VERSION}")
        rounds.append(_eval_round(url, token))
        _wait(lambda: _eval_done(url, rounds[1]), 300, system, "the second eval round")
        yield Observed(system, system.run_dir, url, rounds)
    finally:
        system.stop()
