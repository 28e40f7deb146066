"""The test a breaker's probe must pass, and the probe's size.

A half-open breaker closes only on evidence that the condition that tripped it is gone. The monitor's window
rule cannot give that evidence on a probe: a pass-rate change is judged only at z ≥ 3 with groups as the unit,
and against a reference pass rate of 0.25 two groups reach at most z ≈ 2.4, so a probe of a domain whose scorer
still credited every answer was judged healthy. Instead, the probe is a hypothesis test of its tripping signal.

Every signal that trips by default is a *rate*: a share of samples (pass_rate_jump, pass_rate_collapse,
truncation_rate, hack_rate, infra_error_rate, scorer_inconsistency) or of groups (diversity_collapse). The
condition persists while the rate is at least ``bad`` (the critical threshold, or for the pass-rate signals the
frozen reference's rate ± the critical change; pass_rate_collapse counts failures). With k events in the probe's n
trials, H0 "the rate is still ``bad``" is rejected by the exact one-sided binomial test when
P(X ≤ k | n, bad) < α (``monitor.breaker.probe_alpha``): only then does the probe pass. The probe's size is the
smallest n at which a healthy domain (the frozen reference's rate) passes with probability at least
``probe_power``, in whole groups, between ``probe_groups`` and ``probe_max_groups``.

Samples of one group are not independent (tasks differ), so the test is exact for the samples drawn and
optimistic for the domain; the critical thresholds are far from healthy rates, which keeps that small. A signal
that is not a rate (reward_shift, length_inflation, entropy_drop, set critical by a user) keeps the window rule
on a probe of at least ``probe_groups`` groups, and so does a rate whose probe holds too few trials for the test
to pass at all (``scorer_inconsistency`` counts only repeated pairs; the verdict says ``inconclusive``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

RATE_SIGNALS = ("pass_rate_jump", "pass_rate_collapse", "truncation_rate", "hack_rate", "infra_error_rate",
                "scorer_inconsistency", "diversity_collapse")
"""Signals whose value is a share of samples (or of groups, ``diversity_collapse``): tested exactly."""


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p), exact (log-space terms); 0 for k < 0, 1 for k ≥ n."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma
    total = 0.0
    for i in range(k + 1):
        total += math.exp(lg(n + 1) - lg(i + 1) - lg(n - i + 1) + i * lp + (n - i) * lq)
    return min(1.0, total)


def rejection_bound(n: int, bad: float, alpha: float) -> int:
    """The largest k with P(X ≤ k | n, bad) < alpha (−1 when even k = 0 is not rare enough under ``bad``)."""
    k = -1
    while k + 1 <= n and binom_cdf(k + 1, n, bad) < alpha:
        k += 1
    return k


def trials_needed(bad: float, healthy: float, alpha: float, power: float, step: int, most: int) -> int:
    """The fewest trials, a multiple of ``step`` up to ``most``, at which a domain at the ``healthy`` rate passes
    the test against ``bad`` with probability ≥ ``power``; ``most`` when none does (or ``healthy`` ≥ ``bad``)."""
    if healthy >= bad:
        return most
    n = step
    while n < most:
        if binom_cdf(rejection_bound(n, bad, alpha), n, healthy) >= power:
            return n
        n += step
    return most


@dataclass(frozen=True)
class RateTest:
    """The probe test of one tripping rate signal: events are ``what`` (passes, failures, truncations...)."""

    signal: str
    bad: float
    """Rate of events at which the condition persists (H0)."""
    healthy: float
    """Rate of events of the frozen reference (the domain before the trip)."""
    what: str
    per_group: bool = False
    """Trials are groups (``diversity_collapse``), not samples."""

    def verdict(self, events: int, trials: int, alpha: float) -> "ProbeVerdict":
        """The exact test on the probe's ``events`` of ``trials``: passes when P(X ≤ events | trials, bad) < alpha.
        ``inconclusive`` when even no event at all could not pass (too few trials: repeated pairs are what they
        are); the monitor then judges the signal by its window rule and says so."""
        p = binom_cdf(events, trials, self.bad) if trials else 1.0
        inconclusive = rejection_bound(trials, self.bad, alpha) < 0
        return ProbeVerdict(self.signal, p < alpha, trials, events, self.bad, self.healthy, p, alpha, self.what,
                            inconclusive)


@dataclass(frozen=True)
class ProbeVerdict:
    """A probe's test, as it goes into the breaker's alert record (``details.probe``)."""

    signal: str
    passed: bool
    n: int
    """Trials judged (samples, or groups for ``diversity_collapse``)."""
    k: int
    """Events among them."""
    bad_rate: float
    healthy_rate: float
    p_value: float
    alpha: float
    events: str
    inconclusive: bool = False
    """Too few trials for the test to pass at all: the signal was judged by the window rule instead."""

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.inconclusive:
            return f"{self.k} {self.events} in {self.n}: too few to test, judged by the window rule"
        return (f"{self.k} {self.events} in {self.n}: P(≤ {self.k} | rate {self.bad_rate:.3g}) = {self.p_value:.3g} "
                f"{'<' if self.passed else '≥'} α {self.alpha:g}")


def rate_test(signal: str, critical: float | None, min_rise: float | None, reference: dict[str, float],
              warning: float | None = None) -> RateTest | None:
    """The test of ``signal`` given its critical threshold (and ``min_rise``) and the frozen reference's rates
    (``reference``: ``pass``, ``truncated``, ``hacked``; a rate it lacks counts as 0); None for a signal that is
    not a rate or has no critical level. The signals the reference says nothing of (infra errors, inconsistent
    repeats, collapsed groups: their windows hold the fault) take as the healthy rate half their ``warning``
    threshold (a quarter of the tripping rate without one): a domain at that rate passes a probe of the size
    :func:`trials_needed` gives with probability ``probe_power``, one further below it more often."""
    if critical is None or signal not in RATE_SIGNALS:
        return None
    p_ref = reference.get("pass", 0.0)
    clamp = lambda x: min(1.0, max(0.0, x))  # noqa: E731
    if signal == "pass_rate_jump":
        return RateTest(signal, clamp(p_ref + critical), p_ref, "passes")
    if signal == "pass_rate_collapse":  # failures: the condition is a failure rate of at least 1 − (p_ref − critical)
        return RateTest(signal, clamp(1.0 - (p_ref - critical)), 1.0 - p_ref, "failures")
    if signal in ("truncation_rate", "hack_rate"):
        ref = reference.get("truncated" if signal == "truncation_rate" else "hacked", 0.0)
    else:
        ref = (warning if warning is not None and warning < critical else critical / 2) / 2
    bad = max(critical, ref + min_rise) if min_rise is not None else critical
    what = {"truncation_rate": "truncations", "hack_rate": "hacks", "infra_error_rate": "infra errors",
            "scorer_inconsistency": "inconsistent repeats", "diversity_collapse": "collapsed groups"}[signal]
    return RateTest(signal, clamp(bad), ref, what, per_group=signal == "diversity_collapse")
