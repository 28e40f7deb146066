"""The drift monitor's circuit breakers: one per domain, opened by a critical alert, probed, closed.

**Breaker** per domain: a critical domain alert opens it (the pre-trip reference window is frozen, and
the (task, completion) pairs first seen in the current window are forgotten: they may carry the fault's
rewards). While open, the domain's samples are not recorded except a probe's. After ``cooldown_s`` it goes
half-open and the sampler issues a probe of :meth:`BreakerControl.probe_size` groups; when they are all scored,
the tripping signal is tested exactly against its tripping rate (``scheduler_service/probe.py``) and every other
signal is judged against the frozen reference with the window rule. The test rejects the tripping condition and
no other signal is critical: the breaker closes and the windows restart from the frozen reference. Otherwise it
opens again with the cool-down doubled (up to ``max_cooldown_s``). A breaker opened by an operator (``manual``) is never probed: it waits for a close.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from scheduler_service.config import SIGNALS
from scheduler_service.drift_signals import DomainWatch, Probe, Reading, level_of, sample_of, window_readings
from scheduler_service.probe import RateTest, rate_test, trials_needed
from shared.schemas import Alert, RewardEvent


@dataclass
class Breaker:
    """One domain's circuit breaker, as persisted (``scheduler_service.monitor_store``)."""

    state: str = "closed"
    """``closed`` (trains), ``open`` (no training groups), ``half_open`` (a probe is out)."""
    since: float = 0.0
    """When it entered this state (Unix seconds)."""
    signal: str | None = None
    """The critical signal that opened it (``operator`` when forced)."""
    trips: int = 0
    """Times it opened."""
    manual: bool = False
    """Opened by an operator: no automatic probe."""
    cooldown_s: float = 0.0
    """Seconds from opening to the next probe (doubles after a failed probe)."""
    probe_groups: list[str] = field(default_factory=list)
    """Group ids of the probe out (half-open)."""
    probe_deadline: float | None = None
    last_probe: list[str] = field(default_factory=list)
    """Group ids of the latest probe (the trainer drops them even after the breaker closed)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


class BreakerControl:
    """Breaker and probe methods of :class:`scheduler_service.monitor.DriftMonitor` (a mixin: needs ``cfg``,
    ``clock``, ``breakers``, ``active``, ``changed``, ``thresholds``, ``breaker`` and ``_watch``)."""

    def _probe_sample(self, domain: str, w: DomainWatch, ev: RewardEvent, policy_version: int) -> list[Alert]:
        p = w.probe
        p.sizes[ev.group_id] = ev.group_size
        p.seen[ev.group_id] = p.seen.get(ev.group_id, 0) + 1
        p.infra.append(ev.infra_error)
        c = w.group_sample(ev.group_id, ev.group_size, ev, p.hashes)
        if c is not None:
            p.collapsed.append(c)
        if not ev.infra_error:
            p.samples.append(sample_of(ev))
            rep = w.consistency(ev)
            if rep is not None:
                p.repeats.append(rep)
        if not p.done:
            return []
        return self._finish_probe(domain, w, policy_version)

    def _rate_test(self, domain: str, signal: str | None) -> RateTest | None:
        """The probe test of ``domain``'s tripping ``signal`` against its frozen reference
        (``scheduler_service/probe.py``); None for a signal that is not a rate."""
        if signal is None:
            return None
        t = self.thresholds(domain).get(signal)
        ref = self._watch(domain).frozen or []
        n = len(ref)
        rates = {"pass": sum(s.passed for s in ref) / n, "truncated": sum(s.truncated for s in ref) / n,
                 "hacked": sum(s.hacked for s in ref) / n} if n else {}
        return rate_test(signal, t.critical, t.min_rise, rates, t.warning) if t is not None and t.enabled else None

    def probe_size(self, domain: str) -> int:
        """Groups the next probe of ``domain`` takes: enough for its tripping signal's test to pass a healthy
        domain with probability ``monitor.breaker.probe_power`` (``scheduler_service.probe.trials_needed``),
        between ``probe_groups`` and ``probe_max_groups``."""
        bc = self.cfg.breaker
        test = self._rate_test(domain, self.breaker(domain).signal)
        if test is None:
            return bc.probe_groups
        ref = self._watch(domain).frozen or []
        if test.per_group:
            k = 1  # trials are groups
        else:  # trials are samples: the frozen reference's samples per group (8 before any is known)
            k = max(1, round(len(ref) / len({s.group for s in ref}))) if ref else 8
        n = trials_needed(test.bad, test.healthy, bc.probe_alpha, bc.probe_power, k, bc.probe_max_groups * k)
        return max(bc.probe_groups, min(bc.probe_max_groups, math.ceil(n / k)))

    def _finish_probe(self, domain: str, w: DomainWatch, policy_version: int) -> list[Alert]:
        """Judge a complete probe: its tripping signal by the exact test of ``scheduler_service/probe.py`` (a
        signal that is not a rate, and every other signal, by the window rule against the frozen reference)."""
        p, br = w.probe, self.breakers[domain]
        w.probe = None
        ref = w.frozen or []
        test = self._rate_test(domain, br.signal)
        readings = window_readings(p.samples, ref, p.infra, p.collapsed, p.repeats)
        small = max(1, min(self.cfg.min_samples, len(p.samples)))
        bad = {}
        verdict = None
        if test is not None:
            trials = {"pass_rate_jump": [s.passed for s in p.samples],
                      "pass_rate_collapse": [not s.passed for s in p.samples],
                      "truncation_rate": [s.truncated for s in p.samples], "hack_rate": [s.hacked for s in p.samples],
                      "infra_error_rate": p.infra, "scorer_inconsistency": p.repeats,
                      "diversity_collapse": p.collapsed}[test.signal]
            verdict = test.verdict(sum(map(bool, trials)), len(trials), self.cfg.breaker.probe_alpha)
        for sig, r in readings.items():
            if verdict is not None and sig == test.signal and not verdict.inconclusive:
                continue
            t = self.thresholds(domain)[sig]
            t = t.model_copy(update={"min_samples": min(t.min_samples or small, max(1, r.n))})
            if (r.n_ref is None or r.n_ref >= small) and level_of(r, t, small) == "critical":
                bad[sig] = r
        if verdict is not None and not verdict.passed and not verdict.inconclusive:
            bad = {test.signal: readings.get(test.signal) or Reading(verdict.k / max(1, verdict.n), None,
                                                                      verdict.n), **bad}
        details = {"probe": verdict.to_dict()} if verdict is not None else {}
        said = f" ({verdict.describe()})" if verdict is not None else ""
        if bad:
            sig = next(s for s in SIGNALS if s in bad)
            r = bad[sig]
            return [self._move(domain, br, "open", policy_version, trigger=sig, reading=r,
                               why=f"the probe of {domain} failed on {', '.join(bad)}{said}", details=details)]
        return self._close(domain, br, policy_version, f"the probe was healthy{said}", details=details)

    # ------------------------------------------------------------ breaker

    def _move(self, domain: str, br: Breaker, state: str, policy_version: int, trigger: str | None = None,
              reading: Reading | None = None, why: str = "", manual: bool = False,
              details: dict[str, Any] | None = None) -> Alert:
        """Open ``br`` (from closed, half-open or by an operator); the breaker alert."""
        w = self._watch(domain)
        now = self.clock()
        bc = self.cfg.breaker
        if br.state == "closed":
            cur, ref = w.windows()
            w.frozen = ref or cur
            w.forget_recent_pairs()
            br.cooldown_s = bc.cooldown_s
        else:
            br.cooldown_s = min(bc.max_cooldown_s, max(br.cooldown_s, bc.cooldown_s) * 2)
        w.probe = None
        br.state, br.since, br.signal, br.manual = state, now, trigger, manual
        br.trips += 1
        br.probe_groups, br.probe_deadline = [], None
        self.changed.add(domain)
        msg = (f"{domain}: circuit breaker open ({why}): no training groups of {domain} are issued, its groups in "
               f"flight are dropped by the trainer, evaluation goes on; "
               + ("it stays open until an operator closes it." if manual
                  else f"a probe of {self.probe_size(domain)} group(s) goes out in {br.cooldown_s:.0f} s."))
        a = Alert(domain=domain, signal="breaker", status="firing", severity="critical",
                  value=reading.value if reading else None, policy_version=policy_version, message=msg,
                  details={"state": "open", "trigger": trigger, "trips": br.trips, "cooldown_s": br.cooldown_s,
                           "manual": manual, **(details or {})})
        self.active[a.key] = a
        return a

    def _close(self, domain: str, br: Breaker, policy_version: int, why: str,
               details: dict[str, Any] | None = None) -> list[Alert]:
        w = self._watch(domain)
        br.state, br.since, br.manual = "closed", self.clock(), False
        br.probe_groups, br.probe_deadline = [], None
        w.probe = None
        w.restart(w.frozen)
        w.frozen = None
        self.changed.add(domain)
        self.active.pop(f"{domain}/breaker", None)
        out = [Alert(domain=domain, signal="breaker", status="resolved", severity="info", policy_version=policy_version,
                     message=f"{domain}: circuit breaker closed ({why}); its training groups are issued again.",
                     details={"state": "closed", "trips": br.trips, **(details or {})})]
        for key in [k for k in self.active if k.startswith(f"{domain}/")]:  # judged afresh from the new windows
            old = self.active.pop(key)
            out.append(old.model_copy(update={"status": "resolved", "time": time.time(), "policy_version": policy_version,
                                              "message": f"{domain}: {old.signal} cleared: the breaker closed ({why})."}))
        return out

    def open(self, domain: str, policy_version: int, reason: str = "operator") -> list[Alert]:
        """Force ``domain``'s breaker open (an operator): no probe until :meth:`close`."""
        br = self.breakers.setdefault(domain, Breaker())
        if br.state != "closed" and br.manual:
            return []
        return [self._move(domain, br, "open", policy_version, trigger="operator", why=reason or "operator",
                           manual=True)]

    def close(self, domain: str, policy_version: int, reason: str = "operator") -> list[Alert]:
        """Close ``domain``'s breaker now; nothing when it is closed."""
        br = self.breakers.get(domain)
        if br is None or br.state == "closed":
            return []
        return self._close(domain, br, policy_version, reason or "operator")

    def due_probes(self) -> list[str]:
        """Open, automatically opened breakers whose cool-down is over: the sampler issues their probes."""
        now = self.clock()
        return [d for d, b in self.breakers.items()
                if b.state == "open" and not b.manual and now - b.since >= b.cooldown_s]

    def start_probe(self, domain: str, group_ids: list[str], policy_version: int) -> Alert:
        """``domain`` goes half-open with the probe ``group_ids`` out."""
        br = self.breakers[domain]
        br.state, br.since = "half_open", self.clock()
        br.probe_groups, br.probe_deadline = list(group_ids), br.since + self.cfg.breaker.probe_timeout_s
        br.last_probe = list(group_ids)
        self._watch(domain).probe = Probe(set(group_ids))
        self.changed.add(domain)
        a = Alert(domain=domain, signal="breaker", status="firing", severity="info", policy_version=policy_version,
                  message=f"{domain}: circuit breaker half-open: probing with {len(group_ids)} group(s), scored "
                          f"but not trained.",
                  details={"state": "half_open", "probe_groups": list(group_ids), "trips": br.trips})
        self.active[a.key] = a
        return a

    def expired_probes(self, policy_version: int) -> list[Alert]:
        """Probes past ``probe_timeout_s``: their breakers open again."""
        now, out = self.clock(), []
        for d, b in self.breakers.items():
            if b.state == "half_open" and b.probe_deadline is not None and now > b.probe_deadline:
                out.append(self._move(d, b, "open", policy_version, trigger="probe_timeout",
                                      why="the probe was not scored in time"))
        return out

    def take_changed(self) -> dict[str, Breaker]:
        """Breakers changed since the last call (to persist and announce)."""
        out = {d: self.breakers[d] for d in self.changed if d in self.breakers}
        self.changed = set()
        return out

    def restore(self, breakers: dict[str, Breaker], active: list[Alert]) -> None:
        """After a restart: the persisted breakers and firing alerts (windows start empty; a half-open
        domain's probe is judged on the samples still to come)."""
        self.breakers = dict(breakers)
        self.active = {a.key: a for a in active}
        for d, b in self.breakers.items():
            if b.state == "half_open":
                self._watch(d).probe = Probe(set(b.probe_groups))
