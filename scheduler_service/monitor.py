"""The drift monitor: per-domain windows over flywheel.rewards, alerts, and a circuit breaker per domain.

Pure bookkeeping (no Kafka, no SQLite): the sampler feeds it every RewardEvent, the trainer's Metrics
and each finished eval round, persists what it returns and publishes it (``scheduler_service.sampler``).

The windows and signals are in :mod:`scheduler_service.drift_signals`, the circuit breakers in
:mod:`scheduler_service.breaker`; this module holds the alert states and judges the readings.

**Alerts** are deduplicated per ``<domain>/<signal>``: one record when the level (warning, critical) is
reached or changes, one ``resolved`` when the value falls below every threshold. They do not flap: a warning
fires only after ``monitor.warn_after`` consecutive evaluations at or above it (a critical at once: it opens the
breaker), and a firing alert resolves or steps down only below its threshold by ``monitor.resolve_margin``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from scheduler_service.breaker import Breaker, BreakerControl
from scheduler_service.config import DEFAULT_THRESHOLDS, RUN_SIGNALS, SIGNALS, MonitorConfig, SignalThreshold
from scheduler_service.drift_signals import LEVELS, DomainWatch, Reading, level_of, sample_of, window_readings
from shared.schemas import Alert, Metrics, RewardEvent


class DriftMonitor(BreakerControl):
    """Windows, alert states and breakers of every domain of one scheduler.

    Args:
        cfg: the ``monitor`` section.
        overrides: ``domain -> {signal: {field: value}}`` (the domain config's ``monitor``); called per
            evaluation, so a changed config applies from the next group.
        clock: seconds (Unix time), for breaker timings (tests pass their own).
    """

    def __init__(self, cfg: MonitorConfig, overrides: Callable[[str], dict[str, dict[str, Any]]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        none: dict[str, dict[str, Any]] = {}
        self.overrides = overrides or (lambda d: none)
        self.clock = clock
        self.run_overrides: dict[str, dict[str, Any]] = {}
        self.watches: dict[str, DomainWatch] = {}
        self.active: dict[str, Alert] = {}
        """Firing alerts by key (``<domain>/<signal>``)."""
        self.breakers: dict[str, Breaker] = {}
        self.changed: set[str] = set()
        """Domains whose breaker changed since :meth:`take_changed` (to persist and announce)."""
        self._thresholds: dict[str, tuple[dict, int, dict[str, SignalThreshold]]] = {}
        self._streak: dict[str, int] = {}
        """Consecutive evaluations each alert key has been at warning or above (``monitor.warn_after``)."""
        self._run_rev = 0
        self._first_entropy: float | None = None
        self._eval_acc: dict[str, float] = {}

    # ------------------------------------------------------------ thresholds

    def set_run_overrides(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Replace the run-wide threshold overrides (over ``monitor.signals``)."""
        self.run_overrides = {k: dict(v) for k, v in overrides.items()}
        self._run_rev += 1

    def thresholds(self, domain: str | None) -> dict[str, SignalThreshold]:
        """Effective thresholds of ``domain`` (``None``: run-wide): defaults, then ``monitor.signals``, the
        run-wide overrides, and the domain's ``monitor`` overrides, field by field."""
        over = self.overrides(domain) if domain is not None else {}
        hit = self._thresholds.get(domain or "")
        if hit is not None and hit[0] is over and hit[1] == self._run_rev:
            return hit[2]
        out = {}
        for sig, t in DEFAULT_THRESHOLDS.items():
            merged = t.model_dump()
            for layer in (self.cfg.signals, self.run_overrides, over):
                merged.update(layer.get(sig, {}))
            out[sig] = SignalThreshold.model_validate(merged)
        self._thresholds[domain or ""] = (over, self._run_rev, out)
        return out

    # ------------------------------------------------------------ observations

    def breaker(self, domain: str) -> Breaker:
        """The breaker of ``domain`` (closed when never opened)."""
        return self.breakers.get(domain) or Breaker()

    def _watch(self, domain: str) -> DomainWatch:
        w = self.watches.get(domain)
        if w is None:
            w = self.watches[domain] = DomainWatch(self.cfg)
        return w

    def observe_reward(self, ev: RewardEvent, level: int | None, policy_version: int,
                       selected: bool = False, sample_level: int | None = None) -> list[Alert]:
        """Take one counted RewardEvent while its domain is at level ``level``; the alerts (and breaker moves) it
        causes.

        ``selected``: the sample's group was chosen for its past rewards (a re-sample of an unsolved group,
        ``budget.resample_unsolved``): it counts for the infra-error rate, the scorer's consistency and the
        group's diversity, but not in the reward windows, whose pass rate it would bias toward 0 (one
        24-sample re-sample is most of a 32-sample window). ``sample_level``: the level the sample's task was
        issued at (None: unknown, taken as ``level``); a sample of another level (a group still in flight when
        the curriculum moved) is kept out of the reward windows the same way, so a promotion from a level the
        model passes to one it fails is never a ``pass_rate_collapse``."""
        if not self.cfg.enabled:
            return []
        if sample_level is not None and level is not None and sample_level != level:
            selected = True
        w = self._watch(ev.domain)
        br = self.breakers.get(ev.domain)
        if br is not None and br.state != "closed":
            if w.probe is not None and ev.group_id in w.probe.groups and ev.purpose == "train":
                return self._probe_sample(ev.domain, w, ev, policy_version)
            return []
        if level is not None and w.level is not None and level != w.level:
            w.restart()
        w.level = level
        w.infra.append(ev.infra_error)
        complete = None
        if ev.purpose == "train":
            complete = w.group_sample(ev.group_id, ev.group_size, ev, w.partial)
            if complete is not None:
                w.collapsed.append(complete)
            if not ev.infra_error:
                if not selected:
                    w.samples.append(sample_of(ev))
                rep = w.consistency(ev)
                if rep is not None:
                    w.repeats.append(rep)
        group_done = ev.purpose == "train" and ev.group_id not in w.partial
        if not (group_done or ev.infra_error):
            return []
        cur, ref = w.windows()
        readings = window_readings(cur, ref, list(w.infra), list(w.collapsed), list(w.repeats))
        return self._judge(ev.domain, readings, policy_version)

    def readings(self, domain: str) -> dict[str, Reading]:
        """The current value of every window signal of ``domain`` (what the next completed group is judged on)."""
        w = self.watches.get(domain)
        if w is None:
            return {}
        cur, ref = w.windows()
        return window_readings(cur, ref, list(w.infra), list(w.collapsed), list(w.repeats))

    def observe_metrics(self, m: Metrics) -> list[Alert]:
        """Take the trainer's run-wide Metrics (``domain`` None): the ``kl`` and ``entropy_collapse`` signals."""
        if not self.cfg.enabled or m.source != "trainer" or m.domain is not None:
            return []
        readings = {}
        kl = m.values.get("loss/kl_ref_mean")
        if kl is not None:
            readings["kl"] = Reading(float(kl), None, 1, unit="steps")
        ent = m.values.get("loss/entropy")
        if ent is not None and ent > 0:
            if self._first_entropy is None:
                self._first_entropy = float(ent)
            readings["entropy_collapse"] = Reading(1.0 - ent / self._first_entropy, self._first_entropy, 1,
                                                   unit="steps")
        return self._judge(None, readings, m.policy_version or 0)

    def observe_eval(self, domain: str, accuracy: float, n: int, policy_version: int) -> list[Alert]:
        """Take one finished eval round's accuracy of ``domain`` over ``n`` held-out tasks."""
        if not self.cfg.enabled:
            return []
        prev = self._eval_acc.get(domain)
        self._eval_acc[domain] = accuracy
        if prev is None:
            return []
        return self._judge(domain, {"eval_accuracy_drop": Reading(prev - accuracy, prev, n, unit="rounds")},
                           policy_version)

    # ------------------------------------------------------------ alerts

    def _judge(self, domain: str | None, readings: dict[str, Reading], policy_version: int) -> list[Alert]:
        """Alerts for the readings whose level changed; a critical domain signal opens the breaker."""
        out: list[Alert] = []
        th = self.thresholds(domain)
        trip: tuple[str, Reading] | None = None
        for sig in [s for s in SIGNALS if s in readings]:  # most specific first: it names the trip
            r = readings[sig]
            if (domain is None) != (sig in RUN_SIGNALS):
                continue
            t = th[sig]
            key = f"{domain if domain is not None else 'run'}/{sig}"
            old = self.active.get(key)
            lvl = self._held(key, level_of(r, t, self.cfg.min_samples), old, r,
                             streak=sig not in RUN_SIGNALS and sig != "eval_accuracy_drop")
            if lvl is None:
                if old is not None and r.n >= (t.min_samples or self.cfg.min_samples):
                    del self.active[key]
                    out.append(self._alert(domain, sig, r, old.threshold, "resolved", old.severity, policy_version))
                continue
            if old is not None and old.severity == lvl:
                continue
            a = self._alert(domain, sig, r, getattr(t, lvl), "firing", lvl, policy_version)
            self.active[key] = a
            out.append(a)
            if lvl == "critical" and trip is None:
                trip = (sig, r)
        if trip is not None and domain is not None and self.breaker(domain).state == "closed":
            br = self.breakers.setdefault(domain, Breaker())
            out.append(self._move(domain, br, "open", policy_version, trigger=trip[0], reading=trip[1],
                                  why=f"{trip[0]} is critical"))
        return out

    def _held(self, key: str, lvl: str | None, old: Alert | None, r: Reading, streak: bool = True) -> str | None:
        """The level an alert key takes after this evaluation, with Prometheus-style ``for`` and hysteresis: a
        warning of a window signal (``streak``; not the eval rounds' or the run-wide signals, each of whose
        evaluations is a whole round or step) is reached only after ``monitor.warn_after`` consecutive evaluations
        at or above it (a critical at once); a firing alert keeps its level until the value is below the threshold
        it crossed by ``monitor.resolve_margin`` of that threshold."""
        self._streak[key] = self._streak.get(key, 0) + 1 if lvl is not None else 0
        if old is not None and old.threshold is not None and LEVELS.index(lvl or "warning") <= LEVELS.index(
                old.severity) and (lvl is None or lvl != old.severity):
            held = r.value >= old.threshold - self.cfg.resolve_margin * abs(old.threshold)
            if held:  # still within the margin of the threshold it crossed: no change yet
                return old.severity
        if lvl == "warning" and old is None and streak and self._streak[key] < self.cfg.warn_after:
            return None
        return lvl

    def _alert(self, domain: str | None, sig: str, r: Reading, threshold: float | None, status: str,
               severity: str, policy_version: int) -> Alert:
        where = domain if domain is not None else "the run"
        ref = f" (reference {r.reference:.3g})" if r.reference is not None else ""
        if status == "resolved":
            msg = f"{where}: {sig} is back to {r.value:.3g}{ref}, below its {severity} threshold {threshold}."
        else:
            msg = (f"{where}: {sig} is {r.value:.3g}{ref} over the last {r.n} {r.unit}, at or above the {severity} "
                   f"threshold {threshold}"
                   + ("; the domain's circuit breaker opens." if severity == "critical" and domain is not None
                      and self.breaker(domain).state == "closed" else "."))
        return Alert(domain=domain, signal=sig, status=status, severity=severity, value=r.value, threshold=threshold,
                     reference=r.reference, window=r.n, window_unit=r.unit, policy_version=policy_version, message=msg)
