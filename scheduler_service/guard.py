"""The scheduler's drift guard: runs :class:`scheduler_service.monitor.DriftMonitor` on what the sampler
reads, persists and publishes its alerts, announces breaker and pause changes, issues probes, and applies
operator control records.

- Every alert is stored in the registry (``GET /v1/alerts``), logged (critical at ERROR, warning at
  WARNING, info at INFO) and sent on flywheel.alerts, key ``<domain>/<signal>``.
- A change of whether a domain trains (breaker opened or closed, domain paused or resumed) is announced as
  a ``Control(command="domain_state")`` on flywheel.control: the trainer drops the groups of a domain that
  does not train (``circuit_open``, ``domain_paused``).
- A breaker whose cool-down is over gets its probe (unless its domain is paused or retired): the training
  groups :meth:`~scheduler_service.monitor.DriftMonitor.probe_size` asks for, of the domain's current level, sent like any group (the trainer drops them unseen: the domain still does not
  train) and judged by the monitor when scored.
- Control records (``shared.schemas.Control``) are read from flywheel.control in the consumer group
  ``<scheduler.consumer_group>-control`` and applied durably before their offsets are committed. The REST
  control routes apply a command at once and publish it (``origin: rest``); the loop skips the records this
  process applied itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from aiokafka import AIOKafkaProducer

from scheduler_service.config import SchedulerSettings, check_overrides, deep_merge
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.monitor import DriftMonitor
from scheduler_service.group_store import IssuedGroup
from scheduler_service.registry import Registry
from shared import topics
from shared.kafka import BrokerWatch, decode_or_dead_letter, send
from shared.schemas import Alert, Control, Metrics, RewardEvent

log = logging.getLogger(__name__)

_LOG_LEVEL = {"critical": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}
_EVAL_JUDGED_KEY = "monitor_eval_judged"
_APPLIED_KEPT = 4096


class ControlError(ValueError):
    """A control command that cannot be applied (unknown domain, bad threshold); the message says why."""


class DriftGuard:
    """Monitor, breakers and control of one scheduler process.

    Args:
        config: the scheduler's settings (``monitor``).
        registry: the opened registry (alerts, breakers, pauses are stored there).
        producer: a started producer, or ``None`` (REST-only use: nothing is published).
        blocked: the planner's set of domains whose training groups are not issued (updated in place).
        metrics: the process's Prometheus families (alerts, dead letters); ``None``: a private set.
        watch: the process's broker watch: a publish gives up at once while the broker is gone
            (:meth:`shared.kafka.BrokerWatch.guard`); ``None``: acks are awaited bare.
    """

    def __init__(self, config: SchedulerSettings, registry: Registry, producer: AIOKafkaProducer | None,
                 blocked: set[str] | None = None, metrics: SchedulerMetrics | None = None,
                 watch: BrokerWatch | None = None) -> None:
        self.cfg = config
        self.registry = registry
        self.producer = producer
        self.watch = watch
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.blocked = blocked if blocked is not None else set()
        self.monitor = DriftMonitor(config.monitor, self._domain_overrides)
        self.monitor.restore(registry.breakers(), registry.active_alerts())
        self.monitor.set_run_overrides(registry.run_overrides())
        self._sync_blocked()
        self._applied: OrderedDict[str, None] = OrderedDict()
        self._eval_checked = 0.0
        self.control_ready = asyncio.Event()
        """Set once the control consumer has its partitions and start offsets (for tests and start-up)."""
        self.name = "scheduler"

    def _domain_overrides(self, domain: str) -> dict[str, dict[str, Any]]:
        row = self.registry.domain(domain)
        return row.config.monitor if row is not None else {}

    def _sync_blocked(self) -> None:
        self.blocked.clear()
        self.blocked.update(d for d, b in self.monitor.breakers.items() if b.state != "closed")

    @property
    def training_paused(self) -> bool:
        """Whether training is paused run-wide (``pause_training``)."""
        return self.registry.training_pause() is not None

    def trainable(self, domain: str) -> bool:
        """Whether ``domain``'s groups are trained: its breaker is closed and it is not paused."""
        row = self.registry.domain(domain)
        paused = row is not None and (row.pause_reason is not None or row.config.state != "active")
        return self.monitor.breaker(domain).state == "closed" and not paused

    # ------------------------------------------------------------ observations

    async def on_reward(self, ev: RewardEvent, selected: bool = False, level: int | None = None) -> None:
        """Feed one counted RewardEvent to the monitor (``selected``: of a re-sample of an unsolved group;
        ``level``: the curriculum level its task was issued at); publish what it raises."""
        row = self.registry.domain(ev.domain)
        await self.emit(self.monitor.observe_reward(ev, row.config.level if row else None,
                                                    self.registry.policy_version, selected, level))

    async def on_metrics(self, m: Metrics) -> None:
        """Feed one Metrics record (the trainer's: run-wide KL and entropy)."""
        alerts = self.monitor.observe_metrics(m)
        await self.emit(alerts)
        crit = [a for a in alerts if a.severity == "critical" and a.status == "firing" and a.domain is None]
        if crit and self.cfg.monitor.pause_training_on_critical and not self.training_paused:
            await self.apply(Control(command="pause_training", reason=crit[0].message, origin="scheduler"))

    async def tick(self, issue: Callable[[list[str | tuple[str, int]]], Awaitable[list[IssuedGroup]]]) -> None:
        """Probes past their deadline re-open; breakers past their cool-down issue a probe (through
        ``issue``: writes and sends training groups of the given task ids); finished eval rounds are judged."""
        v = self.registry.policy_version
        await self.emit(self.monitor.expired_probes(v))
        for d in self.monitor.due_probes():
            row = self.registry.domain(d)
            if row is None or row.pause_reason is not None or row.config.state != "active":
                continue  # a paused or retired domain issues nothing, probes included
            k = self.monitor.probe_size(d)
            tasks = self.registry.next_train_tasks({d: (row.config.level, k)})[d]
            if not tasks:
                continue  # nothing to probe with yet (a generator domain between batches)
            groups = await issue([t for t, _, _ in (tasks * k)[:k]])
            await self.emit([self.monitor.start_probe(d, [g.group_id for g in groups], v)])
        if time.monotonic() - self._eval_checked > 1.0:
            self._eval_checked = time.monotonic()
            await self._judge_evals()

    async def _judge_evals(self) -> None:
        """Per-domain accuracy of each eval round finished since the last look (``eval_accuracy_drop``)."""
        last = int(self.registry.kv_get(_EVAL_JUDGED_KEY, -1))
        for r in self.registry.eval_rounds():
            if r["eval_round"] <= last:
                continue
            if not r["done"]:
                break
            for d, (correct, completed) in self.registry.eval_accuracy_by_domain(r["eval_round"]).items():
                if completed:
                    await self.emit(self.monitor.observe_eval(d, correct / completed, completed,
                                                              self.registry.policy_version))
            self.registry.kv_set(_EVAL_JUDGED_KEY, r["eval_round"])

    # ------------------------------------------------------------ publishing

    async def emit(self, alerts: list[Alert]) -> None:
        """Store, log and publish ``alerts``; persist and announce the breakers they moved."""
        changed = self.monitor.take_changed()
        if not alerts and not changed:
            return
        self.registry.record_alerts(alerts)
        self.registry.save_breakers(changed)
        self._sync_blocked()
        for a in alerts:  # counted as they are published
            self.metrics.alerts.labels(a.severity, a.signal, a.status).inc()
        for a in alerts:
            log.log(_LOG_LEVEL[a.severity], "ALERT %s %s [%s]: %s", a.status, a.key, a.severity, a.message)
        records: list[tuple[str, Any, str]] = [(topics.ALERTS, a, a.key) for a in alerts]
        for d, b in changed.items():
            records.append((topics.CONTROL, self._domain_state(d), d))
        await self._publish(records)

    async def announce(self, domain: str) -> None:
        """Send ``domain``'s ``domain_state`` (after a pause or resume outside :meth:`apply`)."""
        await self._publish([(topics.CONTROL, self._domain_state(domain), domain)])

    async def announce_all(self) -> None:
        """Send every domain's ``domain_state`` (at start: it overrides whatever an earlier run on this broker,
        or this run before a crash, left as the latest record the trainer folds)."""
        await self._publish([(topics.CONTROL, self._domain_state(d), d) for d in sorted(self.registry.domain_rows())])

    def _domain_state(self, domain: str) -> Control:
        ok = self.trainable(domain)
        reason = "" if ok else ("circuit_open" if self.monitor.breaker(domain).state != "closed" else "domain_paused")
        return Control(command="domain_state", domain=domain, trainable=ok, reason=reason, origin="scheduler",
                       drop_groups=self.monitor.breaker(domain).last_probe)

    async def _publish(self, records: list[tuple[str, Any, str]]) -> None:
        """Send and wait for the acks (through :attr:`watch`: with the broker gone it fails at once); a failure
        is logged (the registry holds the state; a breaker's ``domain_state`` is announced again with its next
        change)."""
        if self.producer is None or not records:
            return

        async def acked() -> None:
            futs = [await send(self.producer, t, r, key=k) for t, r, k in records]
            await asyncio.gather(*futs)

        try:
            await (acked() if self.watch is None else self.watch.guard(acked(), self.watch.epoch))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the broker's trouble must not stop scoring
            log.warning("publishing %d alert/control records failed: %r", len(records), e)

    # ------------------------------------------------------------ control

    async def apply(self, ctrl: Control, publish: bool = False) -> dict[str, Any]:
        """Apply one control command durably; with ``publish`` also send it on flywheel.control (REST).

        Returns:
            What changed: ``{"command", "domain", "applied": bool, ...}``.

        Raises:
            ControlError: unknown domain, or thresholds :class:`scheduler_service.config.SignalThreshold` refuses.
        """
        self._applied[ctrl.control_id] = None
        while len(self._applied) > _APPLIED_KEPT:
            self._applied.popitem(last=False)
        out = await self._apply(ctrl)
        if publish:
            await self._publish([(topics.CONTROL, ctrl, ctrl.key)])
        log.warning("control %s (%s, from %s): %s", ctrl.command, ctrl.domain or "run", ctrl.origin, out)
        return out

    async def _apply(self, ctrl: Control) -> dict[str, Any]:
        c, d, reg, v = ctrl.command, ctrl.domain, self.registry, self.registry.policy_version
        out: dict[str, Any] = {"command": c, "domain": d, "applied": True}
        if d is not None and c != "domain_state" and reg.domain(d) is None:
            raise ControlError(f"unknown domain {d!r}")
        if c == "open_breaker":
            await self.emit(self.monitor.open(d, v, ctrl.reason or "operator"))
        elif c == "close_breaker":
            await self.emit(self.monitor.close(d, v, ctrl.reason or "operator"))
        elif c in ("pause_domain", "resume_domain"):
            row = reg.domain(d)
            if c == "pause_domain":
                out["applied"] = row.config.state == "active"
                reg.put_domain(d, row.config.model_copy(update={"state": "paused"}))
            else:
                out["applied"] = reg.resume_domain(d)
            await self._publish([(topics.CONTROL, self._domain_state(d), d)])
        elif c == "set_threshold":
            try:
                over = check_overrides({ctrl.signal: dict(ctrl.threshold)})
            except ValueError as e:
                raise ControlError(str(e)) from None
            if d is None:
                merged = deep_merge(reg.run_overrides(), over)
                reg.set_run_overrides(merged)
                self.monitor.set_run_overrides(merged)
            else:
                row = reg.domain(d)
                reg.put_domain(d, row.config.model_copy(update={"monitor": deep_merge(row.config.monitor, over)}))
            out["thresholds"] = self.monitor.thresholds(d)[ctrl.signal].model_dump()
        elif c == "pause_training":
            out["applied"] = not self.training_paused
            if out["applied"]:
                reg.set_training_pause({"reason": ctrl.reason or "operator", "since": time.time(), "by": ctrl.origin})
        elif c == "resume_training":
            out["applied"] = self.training_paused
            reg.set_training_pause(None)
        else:
            out["applied"] = False  # domain_state: the scheduler's own announcement
        if c in ("pause_training", "resume_training") and out["applied"]:
            paused = c == "pause_training"
            a = Alert(signal="training_paused", status="firing" if paused else "resolved",
                      severity="warning" if paused else "info", policy_version=v,
                      message=f"training {'paused' if paused else 'resumed'} run-wide by {ctrl.origin}"
                              + (f": {ctrl.reason}" if ctrl.reason else "") + ".")
            if paused:
                self.monitor.active[a.key] = a
            else:
                self.monitor.active.pop(a.key, None)
            await self.emit([a])
            if ctrl.origin == "scheduler":  # the monitor's own pause: the trainer reads it here (others sent theirs)
                await self._publish([(topics.CONTROL, ctrl, "run")])
        return out

    async def on_control(self, msg) -> None:
        """Handle one flywheel.control record (malformed: DLQ; our own: skipped; refused: logged)."""
        ctrl = await decode_or_dead_letter(self.producer, msg, Control, self.name)
        if ctrl is None:
            self.metrics.dlq.labels(msg.topic).inc()
            return
        if ctrl.control_id in self._applied or ctrl.origin == "scheduler":
            return
        try:
            await self.apply(ctrl)
        except ControlError as e:
            log.error("control record %s (%s) refused: %s", ctrl.control_id, ctrl.command, e)
