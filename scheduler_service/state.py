"""What the REST API and the sampler share in one scheduler process.

:class:`SchedulerState` holds the config, the registry, the Kafka producer, the broker watch and the
sampler, plus the in-memory statistics of ``GET /v1/status`` (:class:`scheduler_service.stats.Stats`). The
sampler gets these parts, not the state, so this module imports the sampler and not the other way round.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaProducer

from scheduler_service.config import SchedulerSettings
from scheduler_service.consumer_loops import CLIENT_STOP_DOWN_TIMEOUT_S, CLIENT_STOP_TIMEOUT_S
from scheduler_service.guard import DriftGuard
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.metrics_feed import watch_state
from scheduler_service.registry import Registry
from scheduler_service.sampler import Sampler
from scheduler_service.stats import Stats
from shared import topics
from shared.kafka import BrokerWatch, ensure_topics, make_producer, send, stop_clients
from shared.schemas import Control, Task

log = logging.getLogger(__name__)


class SchedulerState:
    """Config, registry, producer, broker watch, sampler and statistics of one scheduler process.

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
        self.metrics = SchedulerMetrics()
        """Prometheus families of this process (``GET /metrics``); the gauges read the registry when scraped."""
        watch_state(self.metrics, registry, lambda: self.guard)
        self.producer: AIOKafkaProducer | None = None
        self.watch: BrokerWatch | None = None
        """The process's one broker watch (made by :meth:`start`): the sampler's commits and sends, and the task
        publishes, are awaited through it."""
        self.sampler: Sampler | None = None
        self._guard: DriftGuard | None = None
        self._background: set[asyncio.Task] = set()
        self.prompt_counter: Any = None
        """The policy's tokenizer and context for ``POST /v1/tasks`` (``scheduler_service.routes.tasks.PromptCounter``,
        made on the first batch)."""

    @property
    def guard(self) -> DriftGuard:
        """The sampler's drift guard; without Kafka, one that publishes nothing (REST-only use)."""
        if self.sampler is not None:
            return self.sampler.guard
        if self._guard is None:
            self._guard = DriftGuard(self.config, self.registry, None, metrics=self.metrics)
        return self._guard

    async def control(self, ctrl: Control) -> dict[str, Any]:
        """Apply an operator command now and publish it on flywheel.control (when Kafka is on).

        Raises:
            scheduler_service.guard.ControlError: unknown domain or refused thresholds.
        """
        return await self.guard.apply(ctrl, publish=True)

    async def start(self) -> None:
        """Apply the config's ``domains`` to the registry; start the broker watch, create topics (the default
        ones and each configured pool's), start the producer and the sampler (when ``kafka``).

        Raises:
            aiokafka.errors.KafkaError: the broker cannot be reached.
        """
        applied = await asyncio.to_thread(self.registry.apply_configured, self.config.domains)
        if applied:
            log.info("applied the config of %d domains: %s", len(applied), ", ".join(applied[:10]))
        if not self.kafka:
            return
        self.watch = BrokerWatch(self.config.kafka, "scheduler")
        self.watch.start()
        try:
            pools = {topics.rollout_requests(d.pool) for d in self.config.domains.values()}
            await ensure_topics(self.config.kafka, sorted(set(topics.ALL) | pools))
            self.producer = make_producer(self.config.kafka, client_id="scheduler")
            await self.producer.start()
        except BaseException:
            await self.watch.close()
            self.watch = None
            raise
        self.sampler = Sampler(self.config, self.registry, self.producer, self.stats, self.metrics, watch=self.watch)
        await self.sampler.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the sampler, wait (bounded) for background publishes, close the producer (within
        ``consumer_loops.CLIENT_STOP_TIMEOUT_S``, or ``CLIENT_STOP_DOWN_TIMEOUT_S`` with the broker gone: its
        unsent records could not be delivered; errors logged, never raised), then the broker watch."""
        try:
            if self.sampler is not None:
                await self.sampler.stop(timeout_s)
            if self._background:
                await asyncio.wait(self._background, timeout=timeout_s)
        finally:
            if self.producer is not None:
                down = self.watch is not None and not self.watch.up
                await stop_clients(self.producer,
                                   timeout_s=CLIENT_STOP_DOWN_TIMEOUT_S if down else CLIENT_STOP_TIMEOUT_S)
                self.producer = None
            if self.watch is not None:
                await self.watch.close()
                self.watch = None

    def publish_tasks(self, tasks: list[Task]) -> None:
        """Publish registered tasks on flywheel.tasks in the background, best-effort (failures are logged)."""
        if self.producer is None or not tasks:
            return
        t = asyncio.create_task(self._publish(tasks))
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _publish(self, tasks: list[Task]) -> None:
        producer, watch = self.producer, self.watch

        async def acked() -> None:
            futs = [await send(producer, topics.TASKS, t, key=t.task_id) for t in tasks]
            await asyncio.gather(*futs)

        try:  # with the broker gone, not sent (and nothing for stop() to wait for)
            await (acked() if watch is None else watch.guard(acked(), watch.epoch))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # best-effort: the registry is the source of truth
            log.warning("publishing %d tasks on %s failed: %r", len(tasks), topics.TASKS, e)
