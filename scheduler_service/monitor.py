"""The drift monitor: per-domain windows over flywheel.rewards, alerts, and a circuit breaker per domain.

Pure bookkeeping (no Kafka, no SQLite): the sampler feeds it every RewardEvent, the trainer's Metrics
and each finished eval round, persists what it returns and publishes it (``scheduler_service.sampler``).

**Windows.** Per domain, the latest ``monitor.window`` scored training samples (the *current* window) and
the ``monitor.reference`` samples before them (the *reference*). Signals compare the two, so slow genuine
learning moves both and only a change faster than the reference can follow stands out. A level move of the
domain's curriculum restarts its windows (a new level's pass rate is expected to differ), and a sample is judged
at the level its task was issued at: those of groups still in flight at the move never enter the new level's
windows.

**Signals** (``scheduler_service.config.SIGNALS``; thresholds in ``DEFAULT_THRESHOLDS``, docs/guide.md,
"Drift monitoring", says why each):

- ``scorer_inconsistency``: the verifiers are deterministic, so the same completion of the same task must
  get the same reward whatever the policy does. The share of repeated (task, completion) pairs in the
  current window whose reward differs from the first time the pair was seen cannot be explained by
  learning: it is the scorer (or the judge behind it) that changed.
- ``pass_rate_jump`` / ``pass_rate_collapse``: current minus reference pass rate, and the reverse.
- ``reward_shift``: the Wasserstein-1 distance between the current and reference reward distributions, in
  reward units. Chosen over PSI (needs bins, unstable on 32 samples) and KS (blind to how far the mass
  moved; for 0/1 rewards W1 and KS both equal |Δp|, for partial credit W1 also weighs the distance).
- ``length_inflation``: mean completion tokens, current over reference.
- ``truncation_rate``: share of the current window cut at the token budget (finish ``length``).
- ``diversity_collapse``: share of the last ``monitor.group_window`` completed groups whose samples are all
  one answer (:attr:`RewardEvent.completion_hash`) and not all passed (a group converged on a right answer
  is saturation, which the task lifecycle retires, not collapse).
- ``entropy_drop``: 1 − mean surprisal (−log-prob per token, an estimate of the sampling entropy) of the
  current window over the reference's.
- ``hack_rate``: share of the current window flagged by a reward-hacking detector.
- ``infra_error_rate``: share of the domain's latest ``window`` samples, training and evaluation, that were
  infrastructure errors (a sandbox or judge down).
- ``eval_accuracy_drop``: held-out accuracy of the previous evaluation round minus the latest's.
- run-wide ``kl`` (``loss/kl_ref_mean``) and ``entropy_collapse`` (1 − ``loss/entropy`` over its first value).

**Alerts** are deduplicated per ``<domain>/<signal>``: one record when the level (warning, critical) is
reached or changes, one ``resolved`` when the value falls below every threshold. They do not flap: a warning
fires only after ``monitor.warn_after`` consecutive evaluations at or above it (a critical at once: it opens the
breaker), and a firing alert resolves or steps down only below its threshold by ``monitor.resolve_margin``.

**Breaker** per domain: a critical domain alert opens it (the pre-trip reference window is frozen, and
the (task, completion) pairs first seen in the current window are forgotten: they may carry the fault's
rewards). While open, the domain's samples are not recorded except a probe's. After ``cooldown_s`` it goes
half-open and the sampler issues a probe of :meth:`DriftMonitor.probe_size` groups; when they are all scored,
the tripping signal is tested exactly against its tripping rate (``scheduler_service/probe.py``) and every other
signal is judged against the frozen reference with the window rule. The test rejects the tripping condition and
no other signal is critical: the breaker closes and the windows restart from the frozen reference. Otherwise it
opens again with the cool-down doubled (up to ``max_cooldown_s``). A breaker opened by an operator (``manual``) is never probed: it waits for a close.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from scheduler_service.config import DEFAULT_THRESHOLDS, RUN_SIGNALS, SIGNALS, MonitorConfig, SignalThreshold
from scheduler_service.probe import RateTest, rate_test, trials_needed
from shared.schemas import Alert, Metrics, RewardEvent

MIN_SURPRISAL = 0.05
"""Reference surprisal (nats/token) below which ``entropy_drop`` is not judged: a policy that near-deterministic
already has no entropy left to lose, and the ratio of two tiny numbers is noise."""

LEVELS = ("warning", "critical")
"""Alert levels a signal can reach, in order."""


@dataclass(slots=True)
class Sample:
    """What the windows keep of one scored training sample."""

    reward: float
    passed: bool
    group: str
    tokens: int
    truncated: bool
    hacked: bool
    surprisal: float | None


def wasserstein1(a: list[float], b: list[float]) -> float:
    """Wasserstein-1 (earth mover's) distance between the empirical distributions of ``a`` and ``b``:
    ∫ |F_a(x) − F_b(x)| dx over the merged support (as ``scipy.stats.wasserstein_distance``), in the
    samples' units. O((n + m) log(n + m)).

    Raises:
        ValueError: either list is empty.
    """
    if not a or not b:
        raise ValueError("wasserstein1 needs two non-empty samples")
    sa, sb = sorted(a), sorted(b)
    xs = sorted(set(sa) | set(sb))
    total, na, nb = 0.0, len(sa), len(sb)
    for x0, x1 in zip(xs, xs[1:]):
        fa = bisect.bisect_right(sa, x0) / na
        fb = bisect.bisect_right(sb, x0) / nb
        total += abs(fa - fb) * (x1 - x0)
    return total


def _share(flags: Iterable[bool]) -> tuple[float, int]:
    n = s = 0
    for f in flags:
        n += 1
        s += bool(f)
    return (s / n if n else 0.0), n


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class Reading:
    """One signal's value over its window: ``value``, the reference window's same statistic (``None`` when
    the signal has none or it is not known yet), and the sizes the thresholds' ``min_samples`` apply to."""

    value: float
    reference: float | None
    n: int
    n_ref: int | None = None
    unit: str = "samples"
    z: float | None = None
    """For the pass-rate signals: the change over its standard error with groups as the unit (tasks differ
    far more than samples of one task do); below :data:`MIN_Z` the change is not judged."""


MIN_Z = 3.0
"""Smallest z of a pass-rate change that is judged: a window of 4 groups of heterogeneous tasks moves by
0.5 or more by chance alone (the main job's arithmetic tasks pass at anything from 0 to 1)."""


def group_z(cur: list[Sample], ref: list[Sample]) -> float:
    """z of (current − reference) pass rate, each group's pass rate one observation: the two-sample t statistic
    with the pooled variance (the windows share one variance unless something changed; four groups alone
    estimate it badly), floored at 0.01 so two constant windows still give a finite z."""
    def rates(xs: list[Sample]) -> list[float]:
        by: dict[str, list[bool]] = {}
        for x in xs:
            by.setdefault(x.group, []).append(x.passed)
        return [sum(v) / len(v) for v in by.values()]

    rc, rr = rates(cur), rates(ref)
    if not rc or not rr:
        return 0.0
    mc, mr = sum(rc) / len(rc), sum(rr) / len(rr)
    ss = sum((x - mc) ** 2 for x in rc) + sum((x - mr) ** 2 for x in rr)
    pooled = max(0.01, ss / max(1, len(rc) + len(rr) - 2))
    return (mc - mr) / math.sqrt(pooled * (1 / len(rc) + 1 / len(rr)))


def window_readings(cur: list[Sample], ref: list[Sample], infra: list[bool], collapsed: list[bool],
                    repeats: list[bool]) -> dict[str, Reading]:
    """Every per-domain signal except ``eval_accuracy_drop`` from the windows (lists, oldest first):
    ``cur``/``ref`` scored training samples, ``infra`` the latest samples' infra-error flags, ``collapsed``
    one flag per recent completed group, ``repeats`` one flag per repeated (task, completion) pair (True:
    its reward differed)."""
    out: dict[str, Reading] = {}
    nc, nr = len(cur), len(ref)
    if nc:
        p_cur = sum(s.passed for s in cur) / nc
        trunc = sum(s.truncated for s in cur) / nc
        hack = sum(s.hacked for s in cur) / nc
        p_ref = sum(s.passed for s in ref) / nr if nr else None
        trunc_ref = sum(s.truncated for s in ref) / nr if nr else None
        hack_ref = sum(s.hacked for s in ref) / nr if nr else None
        out["truncation_rate"] = Reading(trunc, trunc_ref, nc, nr)
        out["hack_rate"] = Reading(hack, hack_ref, nc, nr)
        if nr:
            z = group_z(cur, ref) if abs(p_cur - p_ref) >= 0.2 else 0.0  # a small change: not worth the test
            out["pass_rate_jump"] = Reading(p_cur - p_ref, p_ref, nc, nr, z=z)
            out["pass_rate_collapse"] = Reading(p_ref - p_cur, p_ref, nc, nr, z=-z)
            out["reward_shift"] = Reading(wasserstein1([s.reward for s in cur], [s.reward for s in ref]),
                                          _mean([s.reward for s in ref]), nc, nr)
            len_ref = sum(s.tokens for s in ref) / nr
            out["length_inflation"] = Reading(sum(s.tokens for s in cur) / nc / max(len_ref, 1.0), len_ref, nc, nr)
            s_cur = _mean([s.surprisal for s in cur if s.surprisal is not None])
            s_ref = _mean([s.surprisal for s in ref if s.surprisal is not None])
            if s_cur is not None and s_ref is not None and s_ref >= MIN_SURPRISAL:
                out["entropy_drop"] = Reading(1.0 - s_cur / s_ref, s_ref, nc, nr)
    share, n = _share(infra)
    if n:
        out["infra_error_rate"] = Reading(share, None, n)
    share, n = _share(collapsed)
    if n:
        out["diversity_collapse"] = Reading(share, None, n, unit="groups")
    share, n = _share(repeats)
    if n:
        out["scorer_inconsistency"] = Reading(share, None, n)
    return out


def level_of(reading: Reading, t: SignalThreshold, min_samples: int) -> str | None:
    """The level (``warning``, ``critical`` or ``None``) ``reading`` reaches under thresholds ``t``: value at
    or above the level's threshold, and with ``min_rise`` also ``value − reference ≥ min_rise`` (no known
    reference: no rise); windows smaller than ``t.min_samples`` (default ``min_samples``) reach nothing, nor
    does a pass-rate change with ``z`` below :data:`MIN_Z`."""
    need = t.min_samples or min_samples
    if not t.enabled or reading.n < need or (reading.n_ref is not None and reading.n_ref < need):
        return None
    if reading.z is not None and reading.z < MIN_Z:
        return None
    if t.min_rise is not None and (reading.reference is None or reading.value - reading.reference < t.min_rise):
        return None
    for lvl in reversed(LEVELS):
        th = getattr(t, lvl)
        if th is not None and reading.value >= th:
            return lvl
    return None


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


@dataclass
class _Probe:
    groups: set[str]
    seen: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    infra: list[bool] = field(default_factory=list)
    collapsed: list[bool] = field(default_factory=list)
    repeats: list[bool] = field(default_factory=list)
    hashes: dict[str, list[tuple[str | None, bool]]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(g in self.sizes and self.seen.get(g, 0) >= self.sizes[g] for g in self.groups)


class DomainWatch:
    """The windows of one domain (see the module docstring)."""

    _MAX_PARTIAL = 4096

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.samples: deque[Sample] = deque(maxlen=cfg.window + cfg.reference)
        self.infra: deque[bool] = deque(maxlen=cfg.window)
        self.collapsed: deque[bool] = deque(maxlen=cfg.group_window)
        self.repeats: deque[bool] = deque(maxlen=cfg.window)
        self.pairs: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self.partial: OrderedDict[str, list[tuple[str | None, bool]]] = OrderedDict()
        self.seq = 0
        self.level: int | None = None
        self.frozen: list[Sample] | None = None
        self.probe: _Probe | None = None

    def restart(self, keep: list[Sample] | None = None) -> None:
        """Empty the windows (a level move, a closed breaker); ``keep`` becomes the reference."""
        self.samples.clear()
        self.samples.extend((keep or [])[-self.cfg.reference:])
        self.infra.clear()
        self.collapsed.clear()
        self.repeats.clear()
        self.partial.clear()

    def windows(self) -> tuple[list[Sample], list[Sample]]:
        """``(current, reference)``: the latest ``window`` samples and those before them."""
        s = list(self.samples)
        k = max(0, len(s) - self.cfg.window)
        return s[k:], s[:k]

    def consistency(self, ev: RewardEvent) -> bool | None:
        """Remember ``ev``'s (task, completion) reward; for a pair seen before, whether the reward differs."""
        if not self.cfg.consistency_pairs or ev.completion_hash is None:
            return None
        key = hashlib.blake2b(f"{ev.task_id}\0{ev.completion_hash}".encode(), digest_size=8).digest()
        self.seq += 1
        old = self.pairs.get(key)
        if old is None:
            self.pairs[key] = (ev.reward, self.seq)
            if len(self.pairs) > self.cfg.consistency_pairs:
                self.pairs.popitem(last=False)
            return None
        self.pairs.move_to_end(key)
        return abs(old[0] - ev.reward) > 1e-6

    def forget_recent_pairs(self) -> None:
        """Forget pairs first seen within the current window (they may carry a fault's rewards)."""
        cut = self.seq - self.cfg.window
        for k in [k for k, (_, s) in self.pairs.items() if s > cut]:
            del self.pairs[k]

    def group_sample(self, gid: str, size: int, ev: RewardEvent,
                     store: dict[str, list[tuple[str | None, bool]]]) -> bool | None:
        """Track ``ev`` in its group; when it completes the group, whether the group collapsed (every sample
        one answer and not all passed; ``None`` while incomplete or when a sample had no hash or failed)."""
        hs = store.get(gid)
        if hs is None:
            hs = store[gid] = []
            if store is self.partial and len(store) > self._MAX_PARTIAL:
                store.popitem(last=False)  # a group whose samples never all came
        hs.append((None if ev.infra_error else ev.completion_hash, ev.passed))
        if len(hs) < size:
            return None
        del store[gid]
        if any(h is None for h, _ in hs):
            return None
        return len({h for h, _ in hs}) == 1 and not all(p for _, p in hs)


def _sample(ev: RewardEvent) -> Sample:
    return Sample(ev.reward, ev.passed, ev.group_id, ev.completion_tokens, ev.finish_reason == "length", bool(ev.hacks),
                  ev.surprisal)


class DriftMonitor:
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
                    w.samples.append(_sample(ev))
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

    def _probe_sample(self, domain: str, w: DomainWatch, ev: RewardEvent, policy_version: int) -> list[Alert]:
        p = w.probe
        p.sizes[ev.group_id] = ev.group_size
        p.seen[ev.group_id] = p.seen.get(ev.group_id, 0) + 1
        p.infra.append(ev.infra_error)
        c = w.group_sample(ev.group_id, ev.group_size, ev, p.hashes)
        if c is not None:
            p.collapsed.append(c)
        if not ev.infra_error:
            p.samples.append(_sample(ev))
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
        self._watch(domain).probe = _Probe(set(group_ids))
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
                self._watch(d).probe = _Probe(set(b.probe_groups))
