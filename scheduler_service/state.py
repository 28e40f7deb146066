"""What the REST API and the sampler share in one scheduler process.

:class:`SchedulerState` holds the config, the registry, the Kafka producer and the sampler, plus
the in-memory statistics of ``GET /v1/status`` (recent rewards, staleness, throughput) and the
trainer's metrics history (rebuilt from flywheel.metrics, read from the earliest offset, on start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from aiokafka import AIOKafkaProducer

from shared import topics
from scheduler_service.config import SchedulerSettings
from shared.kafka import ensure_topics, make_producer, send
from shared.schemas import Metrics, RewardEvent, Task

from scheduler_service.registry import Registry, RewardOutcome

log = logging.getLogger(__name__)


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
        """Keep a trainer Metrics record (deduped by step); True when it was new."""
        if m.source != "trainer" or m.step is None or m.step in self.metrics:
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


class SchedulerState:
    """Config, registry, producer, sampler and statistics of one scheduler process.

    Args:
        config: the system config.
        registry: the opened task registry (closed by the caller).
        kafka: when False nothing talks to Kafka (REST-only use, e.g. tests): tasks are not
            published and no sampler runs.
    """

    def __init__(self, config: SchedulerSettings, registry: Registry, *, kafka: bool = True) -> None:
        self.config = config
        self.registry = registry
        self.kafka = kafka
        self.stats = Stats(config.scheduler.status_window_s, config.scheduler.recent_samples)
        self.producer: AIOKafkaProducer | None = None
        self.sampler: Any = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Create topics, start the producer and the sampler (when ``kafka``).

        Raises:
            aiokafka.errors.KafkaError: the broker cannot be reached.
        """
        if not self.kafka:
            return
        from scheduler_service.sampler import Sampler  # sampler imports this module

        await ensure_topics(self.config.kafka)
        self.producer = make_producer(self.config.kafka, client_id="scheduler")
        await self.producer.start()
        self.sampler = Sampler(self)
        await self.sampler.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the sampler, wait (bounded) for background publishes, close the producer."""
        try:
            if self.sampler is not None:
                await self.sampler.stop(timeout_s)
            if self._background:
                await asyncio.wait(self._background, timeout=timeout_s)
        finally:
            if self.producer is not None:
                await asyncio.wait_for(self.producer.stop(), timeout_s)
                self.producer = None

    def publish_tasks(self, tasks: list[Task]) -> None:
        """Publish registered tasks on flywheel.tasks in the background, best-effort (failures are logged)."""
        if self.producer is None or not tasks:
            return
        t = asyncio.create_task(self._publish(tasks))
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _publish(self, tasks: list[Task]) -> None:
        producer = self.producer
        try:
            futs = [await send(producer, topics.TASKS, t, key=t.task_id) for t in tasks]
            await asyncio.gather(*futs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # best-effort: the registry is the source of truth
            log.warning("publishing %d tasks on %s failed: %r", len(tasks), topics.TASKS, e)
