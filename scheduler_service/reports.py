"""What the scheduler publishes on flywheel.metrics for analysts (``Metrics(source="scheduler")``):

- **Eval results**, once per finished eval round: one run-wide record (``domain`` None) and one per domain
  (:func:`eval_records`). A round is finished when every group is complete or abandoned
  (``Registry.eval_round(...)["done"]``). The last round published is kept in the registry (key
  :data:`EVAL_PUBLISHED_KEY`) after the broker acknowledged it, so a restart publishes no round twice, except
  the one in flight if the process died between the acknowledgement and the write (consumers key eval
  records by ``eval/round`` and ``domain``).
- **Gauges**, every ``scheduler.metrics_interval_s`` seconds: one record of ``scheduler/*`` values
  (:func:`gauge_values`): groups issued, in flight and completed, policy version, throughput, staleness,
  breakers, alerts, pauses and spend.

:class:`Reporter` is driven by the sampler's issue loop (:meth:`Reporter.tick`, every pass); sending is
best-effort: a failure is logged and retried on a later pass, and never stops issuing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from scheduler_service.registry import Registry
from scheduler_service.stats import Stats
from shared import topics
from shared.kafka import BrokerWatch, send
from shared.schemas import Metrics

log = logging.getLogger(__name__)

SOURCE = "scheduler"
EVAL_PUBLISHED_KEY = "metrics_eval_published"
"""Registry key: the id of the last eval round whose records flywheel.metrics acknowledged (-1: none)."""


def eval_records(summary: dict[str, Any], by_domain: dict[str, tuple[int, int]]) -> list[Metrics]:
    """The Metrics records of one finished eval round: run-wide first, then one per domain (name order).

    Args:
        summary: ``Registry.eval_round(r)`` (``eval_round``, ``n``, ``completed``, ``correct``, ``abandoned``,
            ``min_policy_version``, ``policy_versions``).
        by_domain: ``Registry.eval_accuracy_by_domain(r)``: ``{domain: (correct, completed)}``.

    Values: ``eval/accuracy`` = ``eval/correct`` / ``eval/n`` (greedy pass rate over the items scored, infra
    errors left out; absent when none was scored), ``eval/correct``, ``eval/n`` (items scored), ``eval/round``,
    ``eval/min_policy_version``; the run-wide record adds ``eval/items`` (items in the round) and
    ``eval/abandoned``. ``policy_version`` is the newest behaviour version among the round's answers
    (the round's ``min_policy_version`` when none answered), as ``flywheel run --report`` reports it.
    """
    rid = int(summary["eval_round"])
    version = max(summary.get("policy_versions") or [summary["min_policy_version"]])

    def values(correct: int, n: int) -> dict[str, float]:
        out = {"eval/correct": float(correct), "eval/n": float(n), "eval/round": float(rid),
               "eval/min_policy_version": float(summary["min_policy_version"])}
        if n:
            out["eval/accuracy"] = correct / n
        return out

    run_wide = values(int(summary["correct"]), int(summary["completed"]))
    run_wide.update({"eval/items": float(summary["n"]), "eval/abandoned": float(summary["abandoned"])})
    out = [Metrics(source=SOURCE, policy_version=version, values=run_wide)]
    for d in sorted(by_domain):
        correct, n = by_domain[d]
        out.append(Metrics(source=SOURCE, policy_version=version, domain=d, values=values(correct, n)))
    return out


def gauge_values(registry: Registry, stats: Stats, breakers: dict[str, str], active_alerts: int) -> dict[str, float]:
    """The scheduler's ``scheduler/*`` values now.

    Counts: ``groups_issued`` (every group ever sent, all purposes), ``groups_in_flight`` (sent, rewards
    outstanding), ``groups_pending``, ``groups_completed``, ``groups_abandoned``, ``groups_dropped`` (by the
    trainer; ``groups_dropped/<reason>`` per reason), ``train_groups_budgeted`` and ``train_groups_in_flight``
    (the issue budget's view, ``Registry.train_group_counts``), ``samples_scored``, ``tasks_train``,
    ``tasks_eval``. Gauges: ``policy_version``, ``samples_per_s`` (scored samples per second
    over ``scheduler.status_window_s``), ``staleness_mean``/``staleness_max`` (policy versions, recent train
    samples; absent before any), ``train_reward_mean`` (absent before any), ``breakers_open``,
    ``breakers_half_open``, ``alerts_active``, ``domains_paused``, ``training_paused`` (0/1), and
    ``spend/<purpose>/<what>`` summed over domains (samples, generated tokens, seconds...).

    Args:
        breakers: ``{domain: state}`` of the drift monitor's breakers (``closed``, ``open``, ``half_open``).
        active_alerts: alerts firing now.
    """
    g = registry.group_state_counts()
    budgeted, train_in_flight = registry.train_group_counts()
    dropped = registry.dropped_counts()
    tasks = registry.task_counts()
    out: dict[str, float] = {
        "scheduler/policy_version": float(registry.policy_version),
        "scheduler/groups_issued": float(g["issued"] + g["complete"] + g["abandoned"]),
        "scheduler/groups_in_flight": float(g["issued"]),
        "scheduler/groups_pending": float(g["pending"]),
        "scheduler/groups_completed": float(g["complete"]),
        "scheduler/groups_abandoned": float(g["abandoned"]),
        "scheduler/groups_dropped": float(sum(dropped.values())),
        "scheduler/train_groups_budgeted": float(budgeted),
        "scheduler/train_groups_in_flight": float(train_in_flight),
        "scheduler/samples_scored": float(registry.samples_scored()),
        "scheduler/samples_per_s": float(stats.throughput()),
        "scheduler/tasks_train": float(tasks.get("train", 0)),
        "scheduler/tasks_eval": float(tasks.get("eval", 0)),
        "scheduler/breakers_open": float(sum(s == "open" for s in breakers.values())),
        "scheduler/breakers_half_open": float(sum(s == "half_open" for s in breakers.values())),
        "scheduler/alerts_active": float(active_alerts),
        "scheduler/domains_paused": float(len(registry.paused_domains())),
        "scheduler/training_paused": float(registry.training_pause() is not None),
    }
    for reason, n in sorted(dropped.items()):
        out[f"scheduler/groups_dropped/{reason}"] = float(n)
    st = stats.staleness()
    for k in ("mean", "max"):
        if st[k] is not None:
            out[f"scheduler/staleness_{k}"] = float(st[k])
    rm = stats.reward_mean()
    if rm is not None:
        out["scheduler/train_reward_mean"] = float(rm)
    totals: dict[str, float] = {}
    for per in registry.spend().values():
        for purpose, vals in per.items():
            for k, v in vals.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    key = f"scheduler/spend/{purpose}/{k}"
                    totals[key] = totals.get(key, 0.0) + float(v)
    out.update(sorted(totals.items()))
    return out



class Reporter:
    """Publishes the scheduler's eval results and gauges on flywheel.metrics (see the module docstring).

    Args:
        registry: the opened registry (eval rounds, counts; the last round published is kept in it).
        stats: the process's statistics (throughput, staleness, recent reward).
        producer: a started producer.
        interval_s: seconds between two gauge records.
        breakers: returns ``{domain: breaker state}`` now.
        active_alerts: returns the number of alerts firing now.
        watch: the process's broker watch: a send gives up at once while the broker is gone
            (:meth:`shared.kafka.BrokerWatch.guard`; the record goes out on a later pass); ``None``: acks are
            awaited bare.
    """

    def __init__(self, registry: Registry, stats: Stats, producer, interval_s: float, breakers, active_alerts,
                 watch: BrokerWatch | None = None) -> None:
        self.registry, self.stats, self.producer, self.interval_s = registry, stats, producer, interval_s
        self.watch = watch
        self.breakers, self.active_alerts = breakers, active_alerts
        self._next_gauges = time.monotonic()  # the first record goes out on the first pass
        self._next_eval_look = 0.0

    async def tick(self) -> None:
        """Publish the eval rounds finished since the last look (looked at most once a second) and, when due,
        one gauge record. Never raises except ``CancelledError``: a failed send is logged and retried later."""
        now = time.monotonic()
        try:
            if now >= self._next_eval_look:
                self._next_eval_look = now + 1.0
                await self.publish_finished_evals()
            if now >= self._next_gauges:
                self._next_gauges = now + self.interval_s
                values = gauge_values(self.registry, self.stats, self.breakers(), self.active_alerts())
                rec = Metrics(source=SOURCE, policy_version=self.registry.policy_version, values=values)
                await self._send([rec])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reporting must never stop the issue loop
            log.warning("publishing scheduler metrics failed (retrying on a later pass): %r", e)

    async def _send(self, recs: list[Metrics]) -> None:
        """Send ``recs`` on flywheel.metrics and wait for the acks, through :attr:`watch`.

        Raises:
            shared.kafka.BrokerLost: the broker is gone, or went away before every ack came.
            aiokafka.errors.KafkaError: a send failed.
        """
        async def acked() -> None:
            await asyncio.gather(*[await send(self.producer, topics.METRICS, r, SOURCE) for r in recs])

        await (acked() if self.watch is None else self.watch.guard(acked(), self.watch.epoch))

    async def publish_finished_evals(self) -> list[int]:
        """Publish the records of each eval round finished after the last one published, in round order,
        stopping at the first round not finished; returns the round ids published.

        Raises:
            aiokafka.errors.KafkaError: a send failed (the round is published again on the next call).
            shared.kafka.BrokerLost: the broker is gone (likewise).
        """
        done: list[int] = []
        last = int(self.registry.kv_get(EVAL_PUBLISHED_KEY, -1))
        while True:
            summary = self.registry.eval_round(last + 1)
            if summary is None or not summary["done"]:
                return done
            recs = eval_records(summary, self.registry.eval_accuracy_by_domain(last + 1))
            await self._send(recs)
            last += 1
            self.registry.kv_set(EVAL_PUBLISHED_KEY, last)
            done.append(last)
            log.info("eval round %d on %s: accuracy %s over %d items (%d domains)", last, topics.METRICS,
                     recs[0].values.get("eval/accuracy"), summary["completed"], len(recs) - 1)
