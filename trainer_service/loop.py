"""One pass of the trainer's loop (:meth:`TrainLoop.turn`): take scored records into groups, fold
flywheel.control, drop and announce the groups that will never train, take at most one optimizer step
(its publication runs in the background: :mod:`trainer_service.publisher`), and commit what is durable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiokafka import TopicPartition

from shared import kafka, topics
from shared.schemas import Alert, GroupDropped, ScoredTrajectory
from trainer_service.canary import CanaryCheck
from trainer_service.config import TrainerSettings
from trainer_service.control import ControlState, poll_control
from trainer_service.groups import Drop, Group, GroupBuffer
from trainer_service.publisher import Publisher, StepSnapshot
from trainer_service.tracing import GroupTraces
from trainer_service.trainer import PolicyTrainer

log = logging.getLogger("trainer")
DRAIN_TIMEOUT_S = 120.0
"""Seconds a graceful stop waits for the version being published (:meth:`TrainLoop.drain`)."""


class TrainLoop:
    """One pass of the trainer's loop per :meth:`turn`: take records, drop and announce, step, commit.

    Args:
        config: the trainer's settings.
        trainer: the model and optimizer.
        buffer: the group buffer (resumed with the groups already trained).
        consumer: a started consumer of flywheel.scored (manual commits).
        producer: a started producer (drops, dead letters).
        publisher: makes each step durable and announces it, in version order.
        control_consumer: a started consumer of flywheel.control (no group), polled without waiting each
            turn; ``None``: nothing is polled (``control`` stays as given).
        control: the fold of flywheel.control so far (:func:`trainer_service.control.read_control_to_end`);
            ``None``: a fresh :class:`ControlState` (nothing blocked, not paused).
    """

    def __init__(self, config: TrainerSettings, trainer: PolicyTrainer, buffer: GroupBuffer, consumer,
                 producer, publisher: Publisher, control_consumer=None, control: ControlState | None = None) -> None:
        self.config, self.trainer, self.buffer = config, trainer, buffer
        self.consumer, self.producer, self.publisher = consumer, producer, publisher
        self.metrics = publisher.metrics  # Prometheus: drops and dead letters here, steps in the publisher
        self.control_consumer = control_consumer
        self.control = control if control is not None else ControlState()
        self.publishing: asyncio.Task | None = None
        self.last_step_end = self.last_report = time.perf_counter()
        self.pause_logged = False  # the current pause has been reported
        self.traces = GroupTraces()  # each group's trace ends in a train_group span (trained or dropped)
        self.canary: CanaryCheck | None = getattr(trainer, "canary", None)
        self.canary_alerted = False  # a run/canary alert is firing
        self.commit_guard: Callable[[Awaitable], Awaitable] | None = None
        """Wraps every commit (the session's :meth:`shared.kafka.BrokerWatch.guard`): raises
        ``shared.kafka.BrokerLost`` when the broker went away since the clients were made, or goes away while the
        commit waits. Offsets of a lost broker are never committed on its successor, and a commit under way when
        the broker dies does not hold the session: aiokafka's commit waits for a group coordinator until a
        broker answers again (a stop meanwhile could not drain)."""

    async def turn(self) -> None:
        """Intake (≤ 200 ms long-poll), control (no wait), drops, at most one step (none while training
        is paused), then commit what is durable.

        Control is folded after the intake and before the drops and :meth:`GroupBuffer.take`, so a group
        of a domain blocked by a record fetched before this point is never trained.
        """
        budget, buffer, control = self.config.budget, self.buffer, self.control
        await self._intake()
        if self.control_consumer is not None:
            await poll_control(self.control_consumer, self.producer, control)
        training = self.trainer.version < budget.max_steps
        if training:
            buffer.drop_stale(self.trainer.version)
            buffer.drop_blocked(control.blocked, control.drop_groups)
            if self.canary is not None and buffer.ready:
                buffer.drop_unless(self._canary_ok, "dropped_canary")
                await self._canary_alert()
        if buffer.has_drops:
            announced = await _announce_drops(self.producer, buffer, self.trainer.version)
            self.traces.dropped(announced, self.trainer.step, self.trainer.version)
            self.metrics.dropped(announced)
        if not control.training_paused:
            self.pause_logged = False
        if training:
            if control.training_paused:
                self._report_pause()
            elif len(buffer.ready) >= budget.batch_groups and not self.publisher.disk_blocked:
                await self._step()
            else:
                self._report_stall()
        if self.publishing is not None and self.publishing.done():
            self.publishing.result()  # surface a failed save or send
        await self._commit()

    async def drain(self, broker_down_s: Callable[[], float | None] = lambda: None,
                    timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """At a graceful stop: wait for the version being published, then commit.

        Once the broker has been away for ``trainer.drain_broker_wait_s`` (``broker_down_s()``: seconds it has
        been unreachable, ``None`` while it answers; :meth:`shared.kafka.BrokerWatch.down_for`), the
        publisher abandons the announcements it waits on (:meth:`Publisher.abandon`): the version's files are
        still all written (within ``timeout_s``), so a restarted trainer resumes at it exactly and announces
        its weights then (the step's metrics records are not sent); no offset is committed (the trained
        groups' ids are in the trainer state). At ``timeout_s`` seconds the publication is cancelled.

        Raises:
            asyncio.TimeoutError: ``timeout_s`` passed; the publication was cancelled (a write thread that
                still runs keeps the update gate shut until it returns: :meth:`StepSnapshot.in_thread`).
            Whatever the publication raised (a failed write).
        """
        if self.publishing is None:
            return
        publishing, grace = self.publishing, self.config.trainer.drain_broker_wait_s
        deadline = time.monotonic() + timeout_s
        try:
            while not publishing.done():
                now, down = time.monotonic(), broker_down_s()
                if now >= deadline:
                    log.warning("stopping before the version being published was written and announced: it took "
                                "over %.0f s", timeout_s)
                    publishing.cancel()
                    await asyncio.wait({publishing})
                    if publishing.cancelled():
                        raise asyncio.TimeoutError(f"the publication took over {timeout_s:.0f} s")
                    break  # it ended meanwhile: its result or its error below
                if down is not None and down >= grace and not self.publisher.abandoned:
                    log.warning("stopping with the broker away for %.0f s: the version being published is written "
                                "without its announcements (a restarted trainer announces it)", down)
                    self.publisher.abandon()
                await asyncio.wait({publishing}, timeout=min(0.5, deadline - now))
        except asyncio.CancelledError:
            publishing.cancel()
            raise
        if publishing.cancelled():  # by an earlier drain's bound: nothing more to wait for, nothing to commit
            return
        publishing.result()
        if not self.publisher.abandoned:
            await self._commit()

    async def _intake(self) -> None:
        batch = await self.consumer.getmany(timeout_ms=200, max_records=1024)
        for tp, msgs in batch.items():
            for msg in msgs:
                scored = await kafka.decode_or_dead_letter(self.producer, msg, ScoredTrajectory, "trainer")
                if scored is None:
                    self.metrics.dlq.labels(tp.topic).inc()
                self.traces.remember(scored, msg.headers, self.buffer)
                self.buffer.add(scored, (tp.topic, tp.partition), msg.offset)

    async def _commit(self) -> None:
        """Commit per partition the oldest offset not yet trained-and-durable; never while a drop is
        unacknowledged (its records must come back after a crash)."""
        offsets = {TopicPartition(t, p): o for (t, p), o in self.buffer.commit_offsets().items()}
        if offsets and not self.buffer.has_drops:
            commit = self.consumer.commit(offsets)
            await (commit if self.commit_guard is None else self.commit_guard(commit))

    def _report_pause(self) -> None:
        if not self.pause_logged:
            self.pause_logged = True
            log.warning("training paused (flywheel.control): no step at policy version %d, %d groups ready",
                        self.trainer.version, len(self.buffer.ready))
        self._report_stall()

    def _report_stall(self) -> None:
        now = time.perf_counter()
        if now - max(self.last_step_end, self.last_report) > self.config.trainer.stall_report_s:
            self.last_report = now
            paused = ", training paused by flywheel.control" if self.control.training_paused else ""
            log.warning("no step for %.0f s at policy version %d (assigned %s%s): %s", now - self.last_step_end,
                        self.trainer.version, sorted(self.consumer.assignment()), paused, self.buffer.describe())

    def _canary_ok(self, group: Group) -> bool:
        """The canary check of ``group``, made once (when it is first seen ready) and kept on the group."""
        if group.canary_ok is None:
            group.canary_ok = self.canary.check(group).ok
        return group.canary_ok

    async def _canary_alert(self) -> None:
        """Send a ``run/canary`` :class:`Alert` (critical, source ``trainer``) when an engine starts failing the
        canary check, and its ``resolved`` when none fails any more; logged either way. A failed send is logged
        only (the drops and the ``canary/*`` metrics remain)."""
        failing = self.canary.failing
        if bool(failing) == self.canary_alerted:
            return
        self.canary_alerted = bool(failing)
        worst = max(failing.values(), default=0.0)
        if failing:
            msg = (f"engines {sorted(failing)} scored the canary up to {worst:.3f} nats/token away from the "
                   f"published weights: their groups are not trained until they pass again")
            log.error(msg)
        else:
            msg = "every engine passes the canary check again"
            log.warning(msg)
        alert = Alert(source="trainer", signal="canary", status="firing" if failing else "resolved",
                      severity="critical", value=worst, window=0, window_unit="steps",
                      policy_version=self.trainer.version, message=msg[:4096],
                      details={"engines": sorted(failing)})
        try:
            await (await kafka.send(self.producer, topics.ALERTS, alert, alert.key))
        except Exception as e:  # noqa: BLE001 - the broker may be the trouble too; the log line stands
            log.warning("could not send the canary alert (%r)", e)

    async def _step(self) -> None:
        """Train one step now; its publication runs in the background after the previous one's."""
        trainer, buffer, budget = self.trainer, self.buffer, self.config.budget
        wait_s = time.perf_counter() - self.last_step_end
        # with oversampling (budget.oversample > 1) the scheduler issues more groups than a step takes:
        # pick those whose rewards differ first; the rest wait for the next step or go stale (counted)
        # a bounded step: re-samples of unsolved groups are 3x larger, so rows are capped (budget.max_step_samples)
        cap = budget.max_step_samples or 2 * budget.batch_groups * (buffer.smallest_group or 1)
        groups = buffer.take(budget.batch_groups, prefer_informative=budget.oversample > 1, max_samples=cap)
        start_ns = time.time_ns()
        metrics = await asyncio.to_thread(trainer.train_step, groups)
        if self.canary is not None:  # the new version's own scoring, before the next step changes the weights
            await asyncio.to_thread(self.canary.record, trainer.version)
            metrics.update(self.canary.take_metrics())
        self.traces.trained(groups, trainer.step, trainer.version, start_ns, time.time_ns())
        t0 = time.perf_counter()
        done = buffer.done_groups | buffer.in_flight  # includes earlier steps still being saved
        gate = None
        if self.config.trainer.null_step:
            weights, state = {}, {}
        else:
            try:
                # the live tensors, no copy (1.6 GB for SmolLM2: 0.2 s of the step): the next optimizer step waits
                # for the publisher to have written them (PolicyTrainer.update_gate, set by StepSnapshot.release)
                weights, state = trainer.published_weights(), trainer.state_dict(done, copy_optimizer=False)
                gate = trainer.update_gate
                gate.clear()
            except ValueError:  # a CUDA or non-contiguous model: CPU copies, and nothing to wait for
                weights, state = await asyncio.to_thread(lambda: (trainer.published_weights(live=False),
                                                                  trainer.state_dict(done)))
        metrics["time/snapshot_s"] = time.perf_counter() - t0
        metrics["time/update_gate_s"] = trainer.gate_wait_s
        metrics["time/wait_for_data_s"] = wait_s
        for k in ("dropped_stale", "dropped_failed", "dropped_circuit_open", "dropped_domain_paused",
                  "duplicates_skipped", "superseded_unsolved", "dropped_unsolved", "dropped_canary", "deferred_groups"):
            metrics[f"train/{k}_total"] = float(buffer.counters[k])
        metrics["train/trained_groups_total"] = float(buffer.counters["trained_groups"] + len(groups))
        snap = StepSnapshot(groups, weights, state, metrics, trainer.version, trainer.step, gate, trainer.adapter)
        self.traces.step(groups, trainer.step, trainer.version, start_ns, time.time_ns(),
                         {k: v for k, v in metrics.items() if k.startswith("time/")})
        self.publishing = asyncio.create_task(self.publisher.publish(snap, self.publishing))
        self.last_step_end = time.perf_counter()


async def _announce_drops(producer, buffer: GroupBuffer, version: int) -> list[Drop]:
    """Send a :class:`GroupDropped` for each group dropped since the last call and wait for the acks;
    returns the drops announced.

    Logged as it happens (the step whose metrics would count it may never come). On a send failure
    the drops go back to the buffer and are retried on the next pass (returns ``[]``); until then nothing
    is committed.
    """
    drops = buffer.take_drops()
    try:
        futs = []
        for d in drops:
            rec = GroupDropped(group_id=d.group_id, reason=d.reason, policy_version=version,
                               behaviour_version=d.behaviour_version, samples=d.samples)
            futs.append(await kafka.send(producer, topics.GROUP_DROPS, rec, d.group_id))
        await asyncio.gather(*futs)
    except asyncio.CancelledError:
        buffer.return_drops(drops)
        raise
    except kafka.PERMANENT_PRODUCE_ERRORS as e:  # no retry can send them: never block the commits on them
        log.error("announcing %d dropped groups was refused (%r); not retried: the scheduler re-issues them at "
                  "their deadline", len(drops), e)
        return drops
    except Exception as e:  # noqa: BLE001 - broker trouble: keep the notices, retry on the next pass
        buffer.return_drops(drops)
        log.warning("announcing %d dropped groups failed (%r); retrying", len(drops), e)
        await asyncio.sleep(0.5)
        return []
    for d in drops:
        log.info("dropped group %s (%s; behaviour version %s, policy version %d, %d samples): slot returned to the "
                 "scheduler", d.group_id, d.reason, d.behaviour_version, version, d.samples)
    return drops
