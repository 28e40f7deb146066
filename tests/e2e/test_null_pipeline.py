"""The pipeline without a model (``rollout.engine: null``, ``trainer.null_step: true``) trains every
trajectory exactly once, with one and with two replicas of rollout and verifier.

Real processes (``python -m <service>``) on their own embedded broker, driven by
``benchmarks/null_pipeline.py``'s :func:`run_pipeline`, which checks the null trainer's ledger (no
(group, sample) twice, every trained group whole, every step ``batch`` groups) against the scheduler's
registry. Behaviour only: the throughput figures are the benchmark's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from null_pipeline import run_pipeline  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_null_pipeline_trains_every_trajectory_exactly_once(tmp_path, replicas):
    res = run_pipeline(tmp_path, replicas, steps=6, batch=8, k=4, tasks=128, timeout_s=240)
    assert res.problems == [], res.problems
    assert res.trained == 6 * 8 * 4  # steps x groups x samples, each (group, sample) once
