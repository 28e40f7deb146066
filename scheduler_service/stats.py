"""In-memory statistics of one scheduler process, shown by ``GET /v1/status``: recent rewards,
staleness, throughput, and the trainer's metrics history (rebuilt from flywheel.metrics, read from
the earliest offset, on start)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from scheduler_service.reward_store import RewardOutcome
from shared.schemas import Metrics, RewardEvent


class Stats:
    """Recent-window statistics (in memory; lost on restart, rebuilt as events arrive).

    Args:
        window_s: throughput window (seconds).
        recent: train reward events kept for the reward mean and staleness.
    """

    def __init__(self, window_s: float = 60.0, recent: int = 256) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self._scored: deque[float] = deque()
        self._rewards: deque[float] = deque(maxlen=recent)
        self._staleness: deque[int] = deque(maxlen=recent)
        self.metrics: dict[int, dict[str, Any]] = {}
        """Trainer Metrics records by step."""

    def on_reward(self, ev: RewardEvent, outcome: RewardOutcome, policy_version: int) -> None:
        """Account one counted reward event seen while the policy version was ``policy_version``."""
        if not outcome.scored:
            return
        self._scored.append(time.monotonic())
        if ev.purpose == "train":
            self._rewards.append(ev.reward)
            self._staleness.append(max(0, policy_version - ev.policy_version))

    def on_metrics(self, m: Metrics) -> bool:
        """Keep a trainer's run-wide Metrics record (deduped by step; its per-domain records, ``domain``
        set, are left out); True when it was new."""
        if m.source != "trainer" or m.step is None or m.domain is not None or m.step in self.metrics:
            return False
        self.metrics[m.step] = {"step": m.step, "policy_version": m.policy_version, "values": m.values,
                                "time": m.time}
        return True

    def throughput(self) -> float:
        """Scored samples per second over the last ``window_s`` (or since start when shorter)."""
        now = time.monotonic()
        while self._scored and self._scored[0] < now - self.window_s:
            self._scored.popleft()
        span = min(self.window_s, max(now - self.started, 1e-3))
        return len(self._scored) / span

    def staleness(self) -> dict[str, float | None]:
        """``{mean, max}`` of policy version minus behaviour version over recent train events."""
        s = self._staleness
        return {"mean": sum(s) / len(s) if s else None, "max": max(s) if s else None}

    def reward_mean(self) -> float | None:
        """Mean reward of the recent scored train samples (``None`` before any)."""
        return sum(self._rewards) / len(self._rewards) if self._rewards else None

    def history(self) -> list[dict[str, Any]]:
        """Trainer Metrics records in step order."""
        return [self.metrics[k] for k in sorted(self.metrics)]
