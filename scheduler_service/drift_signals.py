"""The drift monitor's windows and the signals computed over them (pure functions and per-domain state).

**Windows.** Per domain, the latest ``monitor.window`` scored training samples (the *current* window) and
the ``monitor.reference`` samples before them (the *reference*). Signals compare the two, so slow genuine
learning moves both and only a change faster than the reference can follow stands out. A level move of the
domain's curriculum restarts its windows (a new level's pass rate is expected to differ), and a sample is judged
at the level its task was issued at: those of groups still in flight at the move never enter the new level's
windows.

**Signals** (``scheduler_service.config.SIGNALS``; thresholds in ``DEFAULT_THRESHOLDS``, docs/guides/drift.md,
"Signals", says why each):

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

:class:`DomainWatch` keeps one domain's windows, :class:`Probe` a half-open breaker's probe samples;
:func:`window_readings` turns windows into :class:`Reading` values and :func:`level_of` judges a reading against
its thresholds. :class:`scheduler_service.monitor.DriftMonitor` feeds them and holds the alert states.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable

from scheduler_service.config import MonitorConfig, SignalThreshold
from shared.schemas import RewardEvent

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
class Probe:
    """The samples of a half-open breaker's probe, judged once every probe group is scored."""

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
        self.probe: Probe | None = None

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


def sample_of(ev: RewardEvent) -> Sample:
    """What the windows keep of a scored training RewardEvent."""
    return Sample(ev.reward, ev.passed, ev.group_id, ev.completion_tokens, ev.finish_reason == "length", bool(ev.hacks),
                  ev.surprisal)
