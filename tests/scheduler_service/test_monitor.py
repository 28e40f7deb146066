"""The drift monitor and the circuit breaker (``scheduler_service.monitor``), fed RewardEvents directly.

Domains are simulated as groups of K = 8 samples drawn from four answers; a fault changes one thing at a
known group. Each test states the bound on groups to detection it checks, from the windows of
:data:`CFG` (window 32 samples = 4 groups, reference 64, min_samples 16).
"""

from __future__ import annotations

import random

import pytest

from scheduler_service.config import MonitorConfig
from scheduler_service.drift_signals import wasserstein1
from scheduler_service.monitor import DriftMonitor
from shared.schemas import RewardEvent

K = 8
CFG = MonitorConfig(window=32, reference=64, min_samples=16, group_window=8,
                    breaker={"cooldown_s": 10, "probe_groups": 2, "max_cooldown_s": 100})
ANSWERS = ["red", "blue", "green", "gold"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ev(domain, gid, i, answer, passed, reward=None, tokens=4, finish="stop", infra=False, hacks=(), purpose="train",
        task="t0", surprisal=1.0):
    return RewardEvent(task_id=task, group_id=gid, trajectory_id=f"{gid}/{i}", sample_index=i, group_size=K,
                       domain=domain, difficulty=0.0, purpose=purpose, reward=float(passed if reward is None else reward),
                       passed=passed, infra_error=infra, completion_tokens=tokens, finish_reason=finish, policy_version=0,
                       completion_hash=answer, surprisal=surprisal, hacks=list(hacks))


class Sim:
    """Feeds groups of one or more domains to a monitor and records what comes out."""

    def __init__(self, seed=0, cfg=CFG):
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.mon = DriftMonitor(cfg, clock=self.clock)
        self.alerts = []
        self.n = {}

    def group(self, domain, p_right=0.25, **fault):
        """One group: each sample answers ``red`` (right) with probability ``p_right``, else another colour."""
        g = self.n[domain] = self.n.get(domain, 0) + 1
        task = f"t{g % 4}"
        out = []
        for i in range(K):
            ans = "red" if self.rng.random() < p_right else self.rng.choice(ANSWERS[1:])
            kw = dict(answer=ans, passed=ans == "red", task=task)
            if fault.get("credit_all"):
                kw["passed"] = True
            if fault.get("collapse"):
                kw.update(answer="blue", passed=False)
            if fault.get("long"):
                kw.update(tokens=64, finish="length")
            if fault.get("infra"):
                kw.update(infra=True, passed=False, reward=0.0)
            ev = _ev(domain, f"{domain}:{g}", i, **kw)
            out += self.mon.observe_reward(ev, 0, 0)
        self.alerts += out
        return out

    def critical(self, domain):
        return [a for a in self.alerts if a.domain == domain and a.severity == "critical" and a.signal != "breaker"]


def test_wasserstein1_matches_the_reference_implementation():
    scipy = pytest.importorskip("scipy.stats")
    rng = random.Random(1)
    for _ in range(50):
        a = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(rng.randint(1, 40))]
        b = [rng.random() for _ in range(rng.randint(1, 40))]
        assert wasserstein1(a, b) == pytest.approx(scipy.wasserstein_distance(a, b), abs=1e-12)
    assert wasserstein1([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(0.25)  # for 0/1 rewards: |Δp|
    with pytest.raises(ValueError):
        wasserstein1([], [1.0])


def _first_trip(sim, domain, fault, groups=40, start=12):
    for g in range(groups):
        out = sim.group(domain, **(fault if g >= start else {}))
        if any(a.signal == "breaker" and a.details.get("state") == "open" for a in out):
            return g - start + 1, out
    return None, []


@pytest.mark.parametrize("fault, signal, bound", [
    ({"credit_all": True}, {"scorer_inconsistency", "pass_rate_jump"}, 3),
    ({"long": True}, {"truncation_rate"}, 3),
    ({"collapse": True}, {"diversity_collapse"}, 6),
    ({"infra": True}, {"infra_error_rate"}, 3),
])
def test_each_fault_trips_its_signal_within_a_bound_and_the_breaker_opens(fault, signal, bound):
    """Bounds (groups of K = 8 after the fault starts): a rate over the 32-sample window passes 0.5 after
    2 faulty groups (16 of 32), the inconsistency share after at most 2, diversity needs 6 of the last 8
    groups collapsed (0.75); one group of slack for the random healthy part."""
    sim = Sim()
    after, out = _first_trip(sim, "a", fault)
    assert after is not None and after <= bound, sim.alerts
    trig = next(a for a in out if a.signal == "breaker").details["trigger"]
    assert trig in signal, out
    assert sim.mon.breaker("a").state == "open"
    assert sim.mon.take_changed() == {"a": sim.mon.breaker("a")}


def test_gradual_learning_from_near_zero_raises_no_critical_alert():
    """The pass rate climbs 0.02 → 0.98 over 40 groups (a fast learner: +0.024 per group), answers diverse."""
    for seed in range(5):
        sim = Sim(seed)
        for g in range(60):
            sim.group("a", p_right=min(0.98, 0.02 + 0.024 * g))
        assert sim.critical("a") == [], [a.message for a in sim.critical("a")]


def test_alerts_are_deduplicated_while_a_condition_holds_and_resolved_when_it_ends():
    cfg = CFG.model_copy(update={"signals": {"truncation_rate": {"critical": None}}})  # warning only: no breaker
    sim = Sim(cfg=cfg)
    for _ in range(12):
        sim.group("a")
    for _ in range(8):
        sim.group("a", long=True)
    firing = [a for a in sim.alerts if a.signal == "truncation_rate"]
    assert [(a.status, a.severity) for a in firing] == [("firing", "warning")]
    assert "a/truncation_rate" in sim.mon.active
    for _ in range(6):
        sim.group("a")
    tr = [a for a in sim.alerts if a.signal == "truncation_rate"]
    assert [a.status for a in tr] == ["firing", "resolved"]
    assert "a/truncation_rate" not in sim.mon.active
    assert sim.mon.breaker("a").state == "closed"


def test_the_breaker_probes_after_its_cooldown_and_closes_when_the_probe_is_healthy():
    sim = Sim()
    after, _ = _first_trip(sim, "a", {"credit_all": True})
    assert after is not None
    for _ in range(3):  # in flight at the trip: ignored
        sim.group("a", credit_all=True)
    assert sim.mon.due_probes() == []
    sim.clock.t += 10
    assert sim.mon.due_probes() == ["a"]
    a = sim.mon.start_probe("a", ["a:p1", "a:p2"], 0)
    assert a.details["state"] == "half_open" and sim.mon.breaker("a").state == "half_open"
    # the fault is still there: the probe fails, the cool-down doubles
    for gid in ("a:p1", "a:p2"):
        for i in range(K):
            sim.alerts += sim.mon.observe_reward(_ev("a", gid, i, "blue", True, task="t1"), 0, 0)
    assert sim.mon.breaker("a").state == "open" and sim.mon.breaker("a").cooldown_s == 20
    sim.clock.t += 20
    sim.mon.start_probe("a", ["a:p3", "a:p4"], 0)
    for gid in ("a:p3", "a:p4"):  # fixed: honest scores, the same answers as before the fault
        for i in range(K):
            ans = ANSWERS[i % 4]
            sim.alerts += sim.mon.observe_reward(_ev("a", gid, i, ans, ans == "red", task="t1"), 0, 0)
    assert sim.mon.breaker("a").state == "closed"
    assert not [k for k in sim.mon.active if k.startswith("a/")]
    for _ in range(10):  # trains normally again, no new trip
        sim.group("a")
    assert sim.mon.breaker("a").state == "closed"


def test_other_domains_are_unaffected_and_a_level_move_restarts_the_windows():
    sim = Sim()
    for g in range(30):
        sim.group("a", credit_all=g >= 12)
        sim.group("b")
    assert sim.mon.breaker("a").state == "open" and sim.mon.breaker("b").state == "closed"
    assert sim.critical("b") == []
    # domain c is promoted: its pass rate falls from ~0.9 to ~0.1 at the move, which is expected
    for g in range(20):
        level = 0 if g < 12 else 1
        gid = f"c:{g}"
        for i in range(K):
            right = sim.rng.random() < (0.9 if level == 0 else 0.1)
            sim.alerts += sim.mon.observe_reward(_ev("c", gid, i, "red" if right else ANSWERS[1 + i % 3], right,
                                                     task=f"c{g % 4}"), level, 0)
    assert sim.critical("c") == []


def test_an_operator_opened_breaker_is_never_probed_and_closes_on_command():
    sim = Sim()
    out = sim.mon.open("a", 3, "maintenance")
    assert out[0].details == {"state": "open", "trigger": "operator", "trips": 1, "cooldown_s": 10.0, "manual": True}
    sim.clock.t += 1000
    assert sim.mon.due_probes() == []
    assert sim.mon.close("a", 3)[0].details["state"] == "closed"
    assert sim.mon.close("a", 3) == []


def test_a_probe_that_is_never_scored_reopens_the_breaker():
    sim = Sim()
    sim.mon.open("a", 0)
    sim.mon.breakers["a"].manual = False
    sim.clock.t += 10
    sim.mon.start_probe("a", ["a:p"], 0)
    sim.clock.t += CFG.breaker.probe_timeout_s + 1
    out = sim.mon.expired_probes(0)
    assert out[0].details["trigger"] == "probe_timeout" and sim.mon.breaker("a").state == "open"


def test_thresholds_merge_defaults_run_overrides_and_domain_overrides():
    over = {"a": {"truncation_rate": {"critical": 0.9}}}
    mon = DriftMonitor(CFG.model_copy(update={"signals": {"hack_rate": {"warning": 0.2}}}), lambda d: over.get(d, {}))
    mon.set_run_overrides({"truncation_rate": {"warning": 0.1}})
    t = mon.thresholds("a")
    assert (t["truncation_rate"].warning, t["truncation_rate"].critical, t["truncation_rate"].min_rise) == (0.1, 0.9, 0.3)
    assert t["hack_rate"].warning == 0.2 and mon.thresholds("b")["truncation_rate"].critical == 0.5
    over["a"] = {"truncation_rate": {"enabled": False}}  # a changed domain config applies from the next look
    assert mon.thresholds("a")["truncation_rate"].enabled is False


def test_run_wide_kl_and_entropy_come_from_the_trainer_metrics():
    from shared.schemas import Metrics

    mon = DriftMonitor(CFG)
    assert mon.observe_metrics(Metrics(source="trainer", values={"loss/kl_ref_mean": 0.01, "loss/entropy": 2.0})) == []
    out = mon.observe_metrics(Metrics(source="trainer", policy_version=5,
                                      values={"loss/kl_ref_mean": 1.5, "loss/entropy": 0.2}))
    assert {(a.signal, a.severity, a.domain) for a in out} == {("kl", "warning", None),
                                                                ("entropy_collapse", "warning", None)}
    assert all(a.policy_version == 5 for a in out)


def test_eval_accuracy_drop_between_rounds():
    mon = DriftMonitor(CFG)
    assert mon.observe_eval("a", 0.8, 10, 1) == []
    out = mon.observe_eval("a", 0.5, 10, 2)
    assert out[0].signal == "eval_accuracy_drop" and out[0].value == pytest.approx(0.3) and out[0].severity == "warning"


def test_a_resample_of_an_unsolved_group_does_not_collapse_the_pass_rate():
    """The main job's false trip: a 24-sample re-sample of an unsolved task (all fail, chosen because it
    failed) filled most of a 32-sample window after groups passing at 0.75. It is left out of the reward
    windows; and even counted, one group is not a significant change (z over groups)."""
    for selected in (True, False):
        sim = Sim()
        for _ in range(12):
            sim.group("a", p_right=1.0)
        before = len(sim.mon.watches["a"].samples)
        for i in range(24):
            ans = ANSWERS[1 + i % 3]
            ev = _ev("a", "a:resample", i, ans, False, task="hard").model_copy(update={"group_size": 24})
            sim.alerts += sim.mon.observe_reward(ev, 0, 0, selected=selected)
        assert len(sim.mon.watches["a"].samples) == (before if selected else min(96, before + 24))
        assert sim.critical("a") == [], [a.message for a in sim.alerts]


def test_a_pass_rate_change_must_be_significant_over_groups():
    """Windows of whole groups passing all or nothing (heterogeneous tasks): a 0.75 drop from 4 groups is
    within what task mix gives (z < 3); the same drop over consistently passing groups is not."""
    from scheduler_service.drift_signals import Sample, group_z, window_readings

    def s(g, ok):
        return Sample(float(ok), ok, g, 4, False, False, 1.0)

    ref = [s(f"r{g}", g % 2 == 0) for g in range(8) for _ in range(8)]  # half the tasks pass, half fail
    cur = [s(f"c{g}", False) for g in range(4) for _ in range(8)]
    assert group_z(cur, ref) > -3 and window_readings(cur, ref, [], [], [])["pass_rate_collapse"].z < 3
    steady = [s(f"r{g}", i < 4) for g in range(8) for i in range(8)]  # every task passes half its samples
    assert group_z(cur, steady) < -3


def _feed(sim, domain, gid, passes, task_prefix, long=False):
    """One group of K samples of fresh tasks (no repeated pair, so the scorer's consistency says nothing): sample i
    passes when ``passes[i]``; answers differ (no collapse); ``long``: cut at the token budget."""
    out = []
    for i in range(K):
        kw = dict(tokens=64, finish="length") if long else {}
        out += sim.mon.observe_reward(_ev(domain, gid, i, f"{gid}-{i}", passes[i], task=f"{task_prefix}{i}", **kw), 0, 0)
    sim.alerts += out
    return out


def _probe(sim, domain, n, **kw):
    """Send the probe the monitor asks for; returns the breaker alert that judged it."""
    size = sim.mon.probe_size(domain)
    sim.clock.t += sim.mon.breaker(domain).cooldown_s
    assert sim.mon.due_probes() == [domain]
    gids = [f"{domain}:probe{n}-{j}" for j in range(size)]
    sim.mon.start_probe(domain, gids, 0)
    out = []
    for gid in gids:
        out += _feed(sim, domain, gid, task_prefix=gid, **kw)
    return next(a for a in out if a.signal == "breaker"), size


@pytest.mark.parametrize("fault", ["credit_all", "long"])
def test_every_probe_fails_while_the_fault_lasts_and_one_passes_once_it_is_fixed(fault):
    """A scorer that credits every answer (all samples pass, no repeated pair to show the inconsistency) and a
    length blow-up (every completion cut at the budget). Under the window rule a 2-group probe of the first
    could never fail (z ≈ 2.4 < 3 at a reference of 0.25); the exact test fails it every time."""
    sim = Sim()
    healthy = [i < 2 for i in range(K)]  # 2 of 8 pass: the reference's 0.25
    for g in range(16):
        _feed(sim, "a", f"a:{g}", healthy, f"h{g}-")
    bad = dict(passes=[True] * K) if fault == "credit_all" else dict(passes=healthy, long=True)
    for g in range(8):
        _feed(sim, "a", f"a:f{g}", task_prefix=f"f{g}-", **bad)
        if sim.mon.breaker("a").state == "open":
            break
    trip = next(a for a in sim.alerts if a.signal == "breaker")
    assert trip.details["trigger"] == ("pass_rate_jump" if fault == "credit_all" else "truncation_rate")
    for n in range(3):  # the fault lasts: every probe fails, with its test in the alert record
        alert, size = _probe(sim, "a", n, **bad)
        assert alert.details["state"] == "open" and sim.mon.breaker("a").state == "open", alert
        probe = alert.details["probe"]
        assert not probe["passed"] and probe["n"] == size * K and probe["p_value"] >= probe["alpha"]
        assert size >= CFG.breaker.probe_groups
    alert, _ = _probe(sim, "a", 9, passes=healthy)  # fixed
    assert alert.details["state"] == "closed" and alert.details["probe"]["passed"], alert
    assert sim.mon.breaker("a").state == "closed"


@pytest.mark.parametrize("p_ref", [0.1, 0.25, 0.5, 0.9])
def test_the_probe_size_lets_a_healthy_domain_pass_and_never_a_fully_inflated_one(p_ref):
    """Sizes for ``pass_rate_jump`` (critical 0.7) from the reference pass rate: a healthy probe passes with
    probability ≥ probe_power (exactly, from the binomial), an all-pass one never."""
    from scheduler_service.probe import binom_cdf, rate_test, rejection_bound, trials_needed

    bc = CFG.breaker
    test = rate_test("pass_rate_jump", 0.7, None, {"pass": p_ref})
    n = trials_needed(test.bad, test.healthy, bc.probe_alpha, bc.probe_power, K, bc.probe_max_groups * K)
    groups = max(bc.probe_groups, -(-n // K))
    trials = groups * K
    assert binom_cdf(rejection_bound(trials, test.bad, bc.probe_alpha), trials, p_ref) >= bc.probe_power
    assert not test.verdict(trials, trials, bc.probe_alpha).passed
    print(f"reference pass rate {p_ref}: the test needs {n} samples; probe of {groups} groups of {K}")


def test_a_promotion_with_groups_of_the_old_level_in_flight_raises_nothing():
    """Level 0 all pass, level 1 all fail; at the move 6 groups of level 0 are still in flight and land first,
    then level 1's. Each sample is judged at the level its task was issued at: no critical alert, no breaker.
    (Judged at the domain's current level, the old level's passes filled the new windows' reference and the new
    level's failures the current window: a pass_rate_collapse every time.)"""
    sim = Sim()
    for g in range(12):
        for i in range(K):
            sim.alerts += sim.mon.observe_reward(_ev("a", f"a:{g}", i, ANSWERS[i % 4], True, task=f"l0-{g}"), 0, 0,
                                                 sample_level=0)
    for g in range(18):  # the domain is at level 1 now: 6 stragglers of level 0, then level 1's groups
        old = g < 6
        gid = f"a:old{g}" if old else f"a:new{g}"
        for i in range(K):
            sim.alerts += sim.mon.observe_reward(
                _ev("a", gid, i, ANSWERS[i % 4], old, task=f"{gid}-t"), 1, 0, sample_level=0 if old else 1)
    assert sim.critical("a") == [] and sim.mon.breaker("a").state == "closed", sim.alerts


def test_a_value_hovering_at_a_threshold_does_not_flap():
    """entropy_drop (warning 0.8) judged at every completed group: touching 0.8 now and then fires nothing
    (monitor.warn_after consecutive evaluations are needed), a steady 0.85 fires once, hovering at 0.79-0.81
    afterwards keeps it firing (it resolves only below 0.8 less monitor.resolve_margin of it), and a real fall
    resolves it once: two state changes where the value crossed the threshold 60 times."""
    from scheduler_service.drift_signals import Reading

    mon = DriftMonitor(CFG)
    values = [0.79, 0.81] * 15 + [0.85] * 4 + [0.81, 0.79] * 15 + [0.5] * 3
    changes = []
    for v in values:
        for a in mon._judge("a", {"entropy_drop": Reading(v, 1.0, 64, 128)}, 0):
            changes.append((a.status, a.severity, v))
    assert changes == [("firing", "warning", 0.85), ("resolved", "warning", 0.5)], changes
