"""The trainer's benchmark mode (``trainer.null_step: true``): every optimizer step is a no-op.

For measuring the message bus and the services without a model (``benchmarks/null_pipeline.py``, with
``rollout.engine: null``), never for training. :class:`NullTrainer` stands where
:class:`trainer_service.trainer.PolicyTrainer` does in :class:`trainer_service.loop.TrainLoop`: the loop
still assembles groups, drops stale, failed and blocked ones (announced on flywheel.group_drops), counts
steps and versions, and the publisher still announces each version on flywheel.weights, sends the step's
metrics and releases the groups' offsets for committing; only the forward, backward and optimizer step,
the model load, the weight snapshot and the checkpoint writes are left out. The WeightUpdate of a null
step names no file (an empty manifest, ``checksum`` ``null:``, a ``path`` inside the checkpoint store that
is never written): only the null rollout engine, which has no weights, takes it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from trainer_service.groups import Group

NULL_CHECKSUM = "null:"
"""``WeightUpdate.checksum`` of a null step's version (no file to check)."""
NULL_LEDGER = "null_trained.jsonl"
"""File in the checkpoint store where the null trainer logs the groups and samples of each step."""


class NullTrainer:
    """The counters of a trainer without a model: ``version`` (policy versions published, 0 at start) and
    ``step`` (optimizer steps), both raised by :meth:`train_step`.

    Nothing survives a restart: a restarted null trainer starts at version 0 and does not know the groups it
    trained (a benchmark starts a fresh run directory and broker).

    Args:
        ledger: when given, each step appends one JSON line ``{"step", "version", "groups": {group_id: [sample
            indices]}}`` to this file (the benchmark's and the test's exactly-once check; ~10 bytes per sample).
    """

    model = None
    adapter = None
    """:attr:`trainer_service.trainer.PolicyTrainer.adapter`: no LoRA."""
    optimizer_restored = False
    gate_wait_s = 0.0
    """:attr:`trainer_service.trainer.PolicyTrainer.gate_wait_s`: a null step writes nothing, so never waits."""

    def __init__(self, ledger: Path | None = None) -> None:
        self.ledger = ledger
        self.step = 0
        self.version = 0
        self.trained_samples = 0
        """Samples of every group passed to :meth:`train_step` (the benchmark's exactly-once check)."""

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """Count one step over ``groups`` (no computation); returns the metric values a real step reports
        that need no model: ``train/reward_mean``, ``train/pass_rate``, ``train/samples``, ``train/groups``,
        ``loss/pg`` (0), ``time/train_step_s`` (seconds of this call)."""
        t0 = time.perf_counter()
        rows = [s for g in groups for s in g.samples.values()]
        rewards = [r.reward.total for r in rows]
        n = max(len(rows), 1)
        self.step += 1
        self.version += 1
        self.trained_samples += len(rows)
        if self.ledger is not None:
            line = {"step": self.step, "version": self.version,
                    "groups": {g.group_id: sorted(g.samples) for g in groups}}
            with open(self.ledger, "ab") as f:
                f.write(orjson.dumps(line) + b"\n")
        return {"train/reward_mean": sum(rewards) / n, "train/pass_rate": sum(x >= 1.0 for x in rewards) / n,
                "train/samples": float(len(rows)), "train/groups": float(len(groups)), "loss/pg": 0.0,
                "train/null_step": 1.0, "time/train_step_s": time.perf_counter() - t0}

    def state_dict(self, done: Any = None) -> dict[str, Any]:
        """Nothing to keep (no checkpoint is written)."""
        return {}
