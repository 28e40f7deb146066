"""The sampler's consumer loops: rewards and group drops, weights and trainer metrics, operator control.

- ``rewards``: flywheel.rewards and flywheel.group_drops in the consumer group ``scheduler.consumer_group``;
  malformed records go to the DLQ; each event is counted once (a polled batch in one registry transaction); a
  group the trainer dropped gives its budget slot back at once; offsets are committed after SQLite.
- ``watch``: flywheel.weights and flywheel.metrics without a group, from the earliest offset: the highest
  weight version is the policy version; trainer metrics feed the history and the drift guard.
- ``control``: flywheel.control in ``<scheduler.consumer_group>-control``, from the latest offset, applied by
  the drift guard.

Each runs until the sampler stops, the broker goes away, or a broker restart is handled
(:meth:`ConsumerLoops._consume`); the sampler restarts it with a new consumer. The loops that commit
(``rewards``, ``control``) commit through the sampler's :class:`shared.kafka.BrokerWatch` (``watch.guard``): with
the broker gone a commit gives up at once with :class:`shared.kafka.BrokerLost` instead of waiting for a
coordinator that is not there, and the loop starts over from the committed offsets once the broker is back (the
batch it had recorded in SQLite is read again and counted once). The group-less ``watch`` loop keeps its
position through an outage (read again from the start, flywheel.metrics would feed the drift monitor the
trainer's old records twice) and starts over only when the broker lost its topics.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer

from scheduler_service.metrics_feed import count_reward
from scheduler_service.reward_store import RewardOutcome
from shared import topics
from shared.kafka import commit_batch, decode_or_dead_letter, make_consumer, stop_clients
from shared.schemas import GroupDropped, Metrics, RewardEvent, WeightUpdate

log = logging.getLogger("scheduler_service.sampler")  # one logger for all of the sampler's loops

CONSUMER_START_TIMEOUT_S = 60.0
"""Bound on starting one of the sampler's consumers (bootstrap and, for a group, the first join), seconds."""
GETMANY_SLACK_S = 5.0
"""How much longer than its own timeout one ``getmany`` may take before the loop gives up on it (a group-less
consumer whose topics vanished with the broker waits in ``Fetcher.fetched_records`` for an assignment, unbounded)."""
CLIENT_STOP_TIMEOUT_S = 5.0
"""Bound on stopping one of the scheduler's Kafka clients (leave the group, flush, close connections), seconds."""
CLIENT_STOP_DOWN_TIMEOUT_S = 1.0
"""The same bound while the broker watch sees the broker gone: nothing can be left or flushed then, and a
producer would otherwise wait ``kafka.request_timeout_ms`` for batches that cannot be delivered."""


class ConsumerLoops:
    """The consumer loops of :class:`scheduler_service.sampler.Sampler` (a mixin: needs its ``cfg``,
    ``registry``, ``producer``, ``stats``, ``metrics``, ``guard``, ``watch``, ``name``, ``broker_restarts``,
    ``_stop``, ``_sleep`` and ``wake``)."""

    async def _consume(self, consumer: AIOKafkaConsumer, handle, commit: bool, on_start=None) -> None:
        """Run ``consumer`` until stopped, or until a broker restart is handled (:attr:`broker_restarts` moves:
        the caller's :meth:`_restarting` then builds a new consumer, from the committed or earliest offsets).
        ``handle`` takes each polled batch as one list of records (in partition order); when it raises, the
        batch is read again. With ``commit``, each handled batch's offsets are committed through
        ``watch.guard``, after ``handle`` (SQLite first, then the commit).

        Raises:
            shared.kafka.BrokerLost: with ``commit``, the broker went away since the consumer was made (checked
                before each batch, and a commit under way is given up); the caller rebuilds it once the broker is
                back.
        """
        epoch, watch_epoch = self.broker_restarts, self.watch.epoch
        try:
            await asyncio.wait_for(consumer.start(), CONSUMER_START_TIMEOUT_S)
        except BaseException:
            await self._close(consumer)
            raise
        try:
            if on_start is not None:
                await on_start(consumer)
            wait_ms = int(min(self.cfg.scheduler.poll_interval_s, 0.2) * 1000) + 50
            while not self._stop.is_set() and epoch == self.broker_restarts:
                if commit:  # a group consumer's position is the broker's: start over from it after an outage
                    self.watch.check(watch_epoch)
                try:  # bounded: after a broker restart aiokafka can wait for a partition assignment forever
                    batch = await asyncio.wait_for(consumer.getmany(timeout_ms=wait_ms, max_records=500),
                                                   wait_ms / 1000 + GETMANY_SLACK_S)
                except asyncio.TimeoutError:
                    continue
                if not batch:
                    continue
                try:
                    await handle([msg for msgs in batch.values() for msg in msgs])
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("handling a batch failed; re-reading it")
                    for tp, msgs in batch.items():
                        consumer.seek(tp, msgs[0].offset)
                    await self._sleep(1.0)
                    continue
                if commit:  # only after handle: the records are in SQLite
                    await self.watch.guard(commit_batch(consumer, batch), watch_epoch)
                self.wake()
        finally:
            await self._close(consumer)

    async def _close(self, *clients) -> None:
        """Stop ``clients`` (:func:`shared.kafka.stop_clients`: errors logged, never raised) within
        :data:`CLIENT_STOP_TIMEOUT_S` each, or :data:`CLIENT_STOP_DOWN_TIMEOUT_S` while the broker is gone (a
        group consumer whose coordinator died, or a producer holding undeliverable batches, would otherwise wait
        on it much longer)."""
        await stop_clients(*clients, timeout_s=CLIENT_STOP_TIMEOUT_S if self.watch.up else CLIENT_STOP_DOWN_TIMEOUT_S)

    async def _rewards_loop(self) -> None:
        consumer = make_consumer(self.cfg.kafka, topics.REWARDS, topics.GROUP_DROPS,
                                 group_id=self.cfg.scheduler.consumer_group, client_id="scheduler-rewards")
        await self._consume(consumer, self._on_outcomes, commit=True)

    async def _on_outcomes(self, msgs: list) -> None:
        """One polled batch of flywheel.rewards and flywheel.group_drops records, in order: each run of
        consecutive rewards is recorded in one registry transaction (:meth:`Registry.record_rewards`)."""
        rewards: list = []
        for msg in msgs:
            if msg.topic == topics.GROUP_DROPS:
                await self._on_rewards(rewards)
                rewards = []
                await self._on_drop(msg)
            else:
                rewards.append(msg)
        await self._on_rewards(rewards)

    async def _decode(self, msg, cls):
        """Decode ``msg`` as ``cls``; a malformed record is dead-lettered, counted, and ``None`` returned."""
        rec = await decode_or_dead_letter(self.producer, msg, cls, self.name)
        if rec is None:
            self.metrics.dlq.labels(msg.topic).inc()
        return rec

    async def _on_drop(self, msg) -> None:
        ev = await self._decode(msg, GroupDropped)
        if ev is None:
            return
        self.metrics.group_drops.labels(ev.reason).inc()
        freed = self.registry.record_drop(ev.group_id, ev.reason)
        if freed is not None:
            log.warning("trainer dropped group %s (%s, behaviour version %s at policy version %d): its slot is "
                        "given back and a new group will be issued", ev.group_id, ev.reason, ev.behaviour_version,
                        ev.policy_version)

    async def _on_rewards(self, msgs: list) -> None:
        """Decode flywheel.rewards records (malformed ones dead-lettered), record them in one registry
        transaction, then act on each outcome in order (pauses, the drift guard, stats, metrics, logs)."""
        events = [ev for ev in [await self._decode(m, RewardEvent) for m in msgs] if ev is not None]
        if not events:
            return
        budget, version = self.cfg.budget, self.registry.policy_version
        # no re-samples once the trainer is done: nothing would train them
        resample_n = budget.resample_unsolved if version < budget.max_steps else 0
        for ev, outcome in zip(events, self.registry.record_rewards(events, resample_n)):
            await self._after_reward(ev, outcome, version)

    async def _after_reward(self, ev: RewardEvent, outcome: RewardOutcome, version: int) -> None:
        # only events of this registry's groups (another deployment's tasks are not ours to pause)
        if ev.misconfigured and outcome.new and self.registry.pause_domain(ev.domain, ev.reason or "misconfigured",
                                                                           ev.task_id):
            log.error("ALERT domain %r paused: the verifier reports its spec is broken (task %s: %s); fix the tasks, "
                      "then POST /v1/domains/%s/resume", ev.domain, ev.task_id, ev.reason, ev.domain)
            await self.guard.announce(ev.domain)
        if outcome.counted:
            await self.guard.on_reward(ev, selected=outcome.selected, level=outcome.level)
        self.stats.on_reward(ev, outcome, version)
        count_reward(self.metrics, ev, outcome, version)
        if outcome.completed:
            log.debug("group %s complete", ev.group_id)  # per group: thousands a second in the null pipeline
        for note in outcome.notes:
            log.info("%s", note)
        if outcome.resample is not None:  # written pending: the issue loop sends it on its next pass
            log.info("group %s unsolved: re-sampling task %s with %d samples as %s", ev.group_id, ev.task_id,
                     outcome.resample.n, outcome.resample.group_id)

    async def _watch_loop(self) -> None:
        consumer = make_consumer(self.cfg.kafka, topics.WEIGHTS, topics.METRICS, group_id=None,
                                 client_id="scheduler-watch")
        await self._consume(consumer, _each(self._on_watch), commit=False)

    async def _on_watch(self, msg) -> None:
        if msg.topic == topics.WEIGHTS:
            wu = await self._decode(msg, WeightUpdate)
            want = self.cfg.scheduler.weights_model or self.cfg.model.name
            if wu is None or wu.model != want:
                return
            if self.registry.raise_policy_version(wu.version):
                log.info("policy version %d (step %d)", wu.version, wu.step)
        else:
            m = await self._decode(msg, Metrics)
            if m is not None:
                self.stats.on_metrics(m)
                await self.guard.on_metrics(m)

    async def _control_loop(self) -> None:
        # a new deployment starts at the end: commands sent to an earlier run on this broker are not ours
        consumer = make_consumer(self.cfg.kafka, topics.CONTROL, group_id=f"{self.cfg.scheduler.consumer_group}-control",
                                 client_id="scheduler-control", offset_reset="latest")
        await self._consume(consumer, _each(self.guard.on_control), commit=True, on_start=self._control_positioned)

    async def _control_positioned(self, consumer: AIOKafkaConsumer) -> None:
        """Wait for the control consumer's partitions and resolve its start offsets, then set
        ``guard.control_ready`` (records sent after that are applied).

        Raises:
            shared.kafka.BrokerLost: the broker went away meanwhile.
        """
        epoch = self.watch.epoch
        while not consumer.assignment() and not self._stop.is_set():
            self.watch.check(epoch)
            batch = await consumer.getmany(timeout_ms=100, max_records=1)  # joins the group
            for msgs in batch.values():
                for msg in msgs:
                    await self.guard.on_control(msg)
        for tp in consumer.assignment():
            await consumer.position(tp)
        self.guard.control_ready.set()


def _each(handle):
    """A batch handler for :meth:`Sampler._consume` that awaits ``handle(record)`` for each record in order."""
    async def handle_batch(msgs: list) -> None:
        for msg in msgs:
            await handle(msg)
    return handle_batch
