"""Drift monitor, alerts and circuit breakers end to end: one fault at a time in one of four domains.

One system (``LocalSystem``: embedded broker, five services) for the module, with the tiny model taught a
mixture of short answers (``tests/support/drift.py``: at temperature 1 the K = 4 samples of a group differ,
stop after a few tokens, and pass at ~0.2; the code domain's function, K = 8, passes at ~0.9) and four domains of
weight 1, each the target of one fault injected at a known time (and policy version) while the other three
keep training:

=========  ==========================================  ==============================  =======================
domain     fault                                       removal                         signal that must trip
=========  ==========================================  ==============================  =======================
``same``   ``temperature`` 0.01: every sample ``red``  ``temperature: null``           ``diversity_collapse``
``long``   ``temperature`` 5: no EOS, budget reached   ``temperature: null``           ``truncation_rate``
``judged`` the scripted judge gives 10 to everything   honest judge again              ``scorer_inconsistency``
                                                                                       or ``pass_rate_jump``
``code``   SIGSTOP of the sandbox: infra errors        SIGCONT                         ``infra_error_rate``
=========  ==========================================  ==============================  =======================

For each fault: the right signal fires, critical, within :data:`BOUNDS` groups of the domain after the fault
started; the breaker opens; no group of the domain is trained after the trip but in the step in progress
(checkpoint store), and its probe groups never; the other three domains keep a third each of the groups
issued while it is open (±:func:`share_tolerance`); once the fault is removed the probe passes and the
breaker closes. Finally no healthy domain raised a critical alert (flywheel.alerts). The faults run in this
order (``same`` first: it needs the taught argmax ``red`` to still be wrong). About 3.5 minutes on 2 quiet
cores (4-5 on busy ones), a minute of it the sandbox fault: a stopped sandbox's requests fail only after
``code_timeout_s`` + 30 s (the verifier's read timeout), and the verifier scores nothing else meanwhile.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flywheel.launcher import LocalSystem  # noqa: E402
from shared.auth import auth_headers, token_from_run_dir  # noqa: E402
from tests.support import drift as h  # noqa: E402
from tests.verifier_service.scripted_judge import ScriptedJudgeServer  # noqa: E402

WINDOW, REFERENCE, MIN_SAMPLES, GROUP_WINDOW = 16, 32, 8, 8
"""``monitor.window``/``reference``/``min_samples``/``group_window``: 4 + 8 groups of K = 4 fill a domain's
windows, so the monitor judges a domain from its 12th group on."""
LR = 1e-9
"""``trainer.lr``: the policy keeps its taught odds for the whole module. At the default 1e-5 the ``same``
pass rate rose from ~0.2 to ~0.5 within two minutes, and a probe of 2 groups judged against a reference window
partly filled with the fault's all-``red`` groups (pass rate ~0.1) could pass 6 of 8 and fail on
``pass_rate_jump`` (one CI run); with the odds fixed that takes 7 of 8 at 0.2 (~1e-4)."""
COOLDOWN_S = 15.0
"""``monitor.breaker.cooldown_s``: long enough for ~50 groups of the other domains while a breaker is open."""
MONITOR = {"window": WINDOW, "reference": REFERENCE, "min_samples": MIN_SAMPLES, "group_window": GROUP_WINDOW,
           "breaker": {"cooldown_s": COOLDOWN_S, "probe_groups": 2, "probe_timeout_s": 120.0}}
K = {d: s.k for d, s in h.DOMAINS.items()}
"""Samples per group: 4, the code domain's 8."""

BOUNDS = {
    "same": math.ceil(0.75 * GROUP_WINDOW) + 1,
    "long": WINDOW // K["long"] + 1,
    "judged": WINDOW // K["judged"] + 2,
    "code": math.ceil(0.5 * WINDOW / K["code"]) + 2,
}
"""Groups of the domain after the fault started of which the monitor had seen a sample when it tripped.

Each bound is the number of faulty groups that take the signal's window past its critical threshold (below),
+1 for the group being scored at the trip (its first samples may be in before the alert), and for the scorer
faults (judge, sandbox) +1 for the group being scored when the fault started (partly healthy). For the
temperature faults add one per *late* group (issued before the PATCH took effect but completed among the
faulty ones: it holds a place of the window).

- ``same`` (groups issued after the PATCH): ``diversity_collapse`` is the share of the last ``group_window``
  completed groups that are all one answer and not all passed; at temperature 0.01 every group is four
  ``red`` (wrong), so after ⌈0.75 · 8⌉ = 6 such groups the share is ≥ 0.75 (critical) whatever came before.
- ``long`` (groups issued after the PATCH): after window / K = 4 of them the current window holds only
  hot samples, ~92 % of which run to the 8-token budget (EOS ~1 % per token at temperature 5): the
  truncation rate is ≫ 0.5 (critical) and has risen ≫ 0.3 (``min_rise``) over the healthy reference (~0).
- ``judged`` (groups scored after the switch): after window / K = 4 of them every sample of the current
  window passed, so ``pass_rate_jump`` = 1 − p_ref ≥ 0.6 (critical) for any reference pass rate ≤ 0.4
  (it is ~0.2). ``scorer_inconsistency`` (a repeated (task, completion) pair rewarded differently: every
  wrong answer seen before) usually fires first, after 2-3 groups.
- ``code`` (groups scored after the SIGSTOP): ``infra_error_rate`` is the share of the latest ``window``
  samples that were infra errors; 0.5 · 16 = 8 infra errors are one group of 8.
"""
EXPECTED = {"same": {"diversity_collapse"}, "long": {"truncation_rate"},
            "judged": {"scorer_inconsistency", "pass_rate_jump"}, "code": {"infra_error_rate"}}


def share_tolerance(n: int) -> float:
    """Tolerance on a domain's share (its weight over the other eligible domains' weights: 1/3 here) of the
    ``n`` groups issued while a breaker is open.

    ``issue_order: fifo`` is the stride mix itself: over any run of decisions each eligible domain is within
    one group of its exact share; the run we count is cut at both ends by events (the trip, the probe) that
    the mix does not see, which can add one group more at each end, so |count − n/3| ≤ 2 (+1 of slack for
    a plan the sampler had made before the breaker opened): 3 / n.
    """
    return 3.0 / n


@dataclass
class Trip:
    """What one fault did (times are Unix seconds)."""

    domain: str
    t_fault: float
    """When the injection started."""
    t_in_force: float
    """When it returned (a PATCH may take a while: groups issued meanwhile may still be healthy)."""
    v_fault: int
    """The scheduler's policy version when the fault was injected."""
    t_removed: float
    alerts: list[dict]
    """The domain's alerts from ``t_fault`` on, oldest first."""
    seen_open: dict = field(default_factory=dict)
    """REST while it was open: ``GET /v1/domains/{d}``'s ``breaker`` and ``GET /v1/status``'s ``breakers``."""
    critical: dict = field(default_factory=dict)
    opened: dict = field(default_factory=dict)
    half_open: dict = field(default_factory=dict)
    closed: dict = field(default_factory=dict)


@dataclass
class Run:
    system: LocalSystem
    judge: h.ScriptedJudge
    probs: dict
    sandbox_pid: int
    trips: dict[str, Trip] = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    """What the tests saw, for the printed report."""

    @property
    def url(self) -> str:
        return self.system.scheduler_url

    def patch(self, domain: str, body: dict) -> dict:
        """PATCH /v1/domains/{domain} with this system's token."""
        return h.patch_domain(self.url, domain, body, token=token_from_run_dir(self.system.run_dir))

    @property
    def db(self) -> Path:
        return self.system.run_dir / "flywheel-registry.db"

    @property
    def checkpoints(self) -> Path:
        return self.system.run_dir / "checkpoints"


def _serving(system: LocalSystem) -> bool:
    try:
        return "serving rollout pool" in (system.run_dir / "logs" / "rollout.log").read_text(errors="replace")
    except OSError:
        return False


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("drift")
    model_dir, probs = h.teach(work / "tiny")
    t_taught = time.monotonic() - t0
    judge = h.ScriptedJudge()
    with ScriptedJudgeServer(judge) as judge_url:
        cfg = work / "system.yaml"
        cfg.write_text(yaml.safe_dump(h.system_config(model_dir, work / "runs", judge_url, MONITOR, lr=LR)))
        # the services import this checkout, whatever the installed package points at
        path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
        system = LocalSystem.start(cfg, work / "run", overrides={"PYTHONPATH": path}, timeout_s=240)
        pid = system.services["sandbox"].process.pid
        try:
            h.wait_for(lambda: _serving(system), 240, system, "the rollout service to serve")
            print(f"\n[drift] taught in {t_taught:.0f} s, serving after {time.monotonic() - t0:.0f} s; answer odds "
                  f"{probs}", flush=True)
            h.submit(system.scheduler_url, h.tasks(16), system.token)
            yield Run(system, judge, probs, pid)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            system.stop()


def _warm(run: Run) -> dict[str, tuple[float, int]]:
    """Wait until every domain has filled its windows (window + reference scored samples); the pass rates."""
    need = WINDOW + REFERENCE

    def ready():
        rates = h.pass_rates(h.train_groups(run.db))
        return rates if len(rates) == len(h.DOMAINS) and all(n >= need for _, n in rates.values()) else None
    return h.wait_for(ready, 240, run.system, f"{need} scored samples per domain", every_s=1.0)


def _alerts_since(run: Run, t: float, domain: str | None = None) -> list[dict]:
    params = {"limit": 10_000} | ({"domain": domain} if domain else {})
    return sorted((a for a in h.get(run.url, "/v1/alerts", **params)["recent"] if a["time"] >= t),
                  key=lambda a: a["time"])


def _breaker_alert(alerts: list[dict], state: str) -> dict:
    return next((a for a in alerts if a["signal"] == "breaker" and a["details"].get("state") == state), {})


def _trip_and_recover(run: Run, domain: str, inject, remove) -> Trip:
    """Inject, wait for the breaker to open, remove, wait for the probe to close it; the alerts on the way."""
    url, system = run.url, run.system
    assert h.breaker(url, domain).get("state", "closed") == "closed"
    v_fault = h.get(url, "/v1/status")["policy_version"]
    t_fault = time.time()
    inject()
    t_in_force = time.time()
    try:
        # 180 s: the sandbox fault's infra errors come ~31 s after each verifier batch that holds code samples
        h.wait_for(lambda: _breaker_alert(_alerts_since(run, t_fault, domain), "open"), 180, system,
                   f"{domain}'s breaker to open")
        seen_open = {"breaker": h.breaker(url, domain), "status": h.get(url, "/v1/status")["breakers"]}
    finally:
        remove()
        t_removed = time.time()
    try:
        h.wait_for(lambda: _breaker_alert(_alerts_since(run, t_fault, domain), "closed"), COOLDOWN_S + 120, system,
                   f"{domain}'s breaker to close after its probe")
    finally:
        if h.breaker(url, domain).get("state", "closed") != "closed":  # leave the system clean for the next fault
            httpx.post(f"{url}/v1/domains/{domain}/breaker/close", timeout=30,
                       headers=auth_headers(token_from_run_dir(system.run_dir)))
    alerts = _alerts_since(run, t_fault, domain)
    trip = Trip(domain, t_fault, t_in_force, v_fault, t_removed, alerts, seen_open,
                opened=_breaker_alert(alerts, "open"), half_open=_breaker_alert(alerts, "half_open"),
                closed=_breaker_alert(alerts, "closed"))
    trip.critical = next((a for a in alerts if a["severity"] == "critical" and a["signal"] != "breaker"
                          and a["status"] == "firing"), {})
    run.trips[domain] = trip
    return trip


def _faulty_groups(run: Run, trip: Trip, by_issue: bool) -> tuple[list[str], list[str]]:
    """Ids of the domain's groups after the fault started of which the monitor had seen a sample when it
    tripped (a reward received before the breaker-open alert): issued after the fault was in force
    (``by_issue``: a temperature takes effect at issue), or with a reward received after it started (a
    scorer's fault takes effect at scoring). With ``by_issue`` also the *late* groups: issued before the
    fault was in force but completed after the first faulty group and before the trip."""
    t_trip = trip.opened["time"]
    seen = {gid: g for gid, g in h.train_groups(run.db).items()
            if g["domain"] == trip.domain and g["first"] is not None and g["first"] <= t_trip}
    if not by_issue:
        return [gid for gid, g in seen.items() if g["last"] > trip.t_fault], []
    faulty = [gid for gid, g in seen.items() if g["issued_at"] > trip.t_in_force]
    first = min((seen[gid]["last"] for gid in faulty), default=t_trip)
    late = [gid for gid, g in seen.items() if g["issued_at"] <= trip.t_in_force and first < g["last"] <= t_trip]
    return faulty, late


def _check_trip(run: Run, trip: Trip, by_issue: bool) -> dict:
    """The assertions every fault shares (see the module docstring); a summary of the figures."""
    summary = _check_detection(run, trip, by_issue)
    groups = h.train_groups(run.db)
    summary |= _check_breaker(run, trip, groups)
    summary |= _check_shares(run, trip, groups)
    return summary


def _check_detection(run: Run, trip: Trip, by_issue: bool) -> dict:
    """The right signal, critical, within the bound; the breaker opened on it."""
    d = trip.domain
    assert trip.opened, f"{d}: no breaker-open alert: {trip.alerts}"
    assert trip.critical, f"{d}: no critical alert: {trip.alerts}"
    crit, t_trip = trip.critical, trip.opened["time"]
    assert crit["signal"] in EXPECTED[d], f"{d}: tripped on {crit['signal']}: {crit['message']}"
    assert trip.opened["details"]["trigger"] == crit["signal"] and trip.opened["severity"] == "critical"
    assert trip.t_fault <= crit["time"] <= t_trip
    br = trip.seen_open["breaker"]
    assert br["state"] in ("open", "half_open") and br["signal"] == crit["signal"] and br["trips"] == 1, br
    assert trip.seen_open["status"].get(d) in ("open", "half_open"), trip.seen_open
    faulty, late = _faulty_groups(run, trip, by_issue)
    assert len(faulty) <= BOUNDS[d] + len(late), \
        f"{d}: tripped after {len(faulty)} groups (bound {BOUNDS[d]}, +{len(late)} late healthy groups)"
    return {"signal": crit["signal"], "value": crit["value"], "threshold": crit["threshold"],
            "reference": crit["reference"], "window": crit["window"], "policy_version": crit["policy_version"],
            "v_fault": trip.v_fault, "faulty_groups": len(faulty), "late_groups": len(late), "bound": BOUNDS[d],
            "patch_s": round(trip.t_in_force - trip.t_fault, 2), "detect_s": round(t_trip - trip.t_fault, 1),
            "warnings": sorted({a["signal"] for a in trip.alerts if a["severity"] == "warning"})}


def _check_breaker(run: Run, trip: Trip, groups: dict[str, dict]) -> dict:
    """One probe after the cool-down (its size chosen by its test), which passed, its verdict in the breaker's
    record; nothing of the domain issued while open but the probe;
    nothing trained after the trip but the step in progress; the probe never trained."""
    d, t_trip = trip.domain, trip.opened["time"]
    assert trip.half_open and trip.closed, trip.alerts
    probes = set(trip.half_open["details"]["probe_groups"])
    t_half, t_closed = trip.half_open["time"], trip.closed["time"]
    # sized by the probe's test of the tripping signal (scheduler_service/probe.py), never below probe_groups
    assert MONITOR["breaker"]["probe_groups"] <= len(probes) <= MONITOR["breaker"].get("probe_max_groups", 16)
    probe = trip.closed["details"].get("probe")
    assert probe is None or (probe["passed"] or probe["inconclusive"]), probe  # the verdict is in the record
    assert t_half - t_trip >= COOLDOWN_S - 0.5
    opens = [a for a in trip.alerts if a["signal"] == "breaker" and a["details"].get("state") == "open"]
    assert len(opens) == 1, f"{d}: the probe failed: {[a['message'] for a in opens]}"
    assert all(groups[g]["domain"] == d and groups[g]["samples"] == K[d] for g in probes), \
        [groups.get(g) for g in probes]
    leaked = [gid for gid, g in groups.items() if g["domain"] == d and t_trip < g["issued_at"] < t_closed
              and gid not in probes]
    assert not leaked, f"{d}: {len(leaked)} groups issued while its breaker was open"
    # a probe is scored, never trained: look once the trainer has taken a few steps past the close
    h.wait_for(lambda: len(_trained_after(run, t_closed)) >= 3, 60, run.system, "3 steps after the close")
    trained = _trained_after(run, t_trip)
    groups = h.train_groups(run.db)  # every group trained so far is in
    probes_trained = {v: sorted(gids & probes) for v, (made, gids) in trained if gids & probes}
    assert not probes_trained, f"{d}: probe groups trained (version: groups): {probes_trained}; breaker closed " \
        f"at {t_closed:.3f}, versions made at {[round(made, 3) for v, (made, _) in trained if v in probes_trained]}"
    # and no other group of the domain issued before the close, but in the step in progress at the trip
    in_progress = sum(groups[gid]["domain"] == d for gid in trained[0][1][1])
    after = [gid for _, (_, gids) in trained[1:] for gid in gids
             if groups[gid]["domain"] == d and groups[gid]["issued_at"] < t_closed]
    assert not after, f"{d}: {len(after)} groups trained after the trip: {after[:4]}"
    dropped = sum(1 for g in groups.values() if g["domain"] == d and g["dropped"] == "circuit_open")
    return {"in_progress_step_groups": in_progress, "dropped_circuit_open": dropped,
            "open_s": round(t_closed - t_trip, 1)}


def _check_shares(run: Run, trip: Trip, groups: dict[str, dict]) -> dict:
    """The other domains' shares of the groups issued while the breaker was open, by weight among them; and
    they kept training meanwhile."""
    d, t_trip, t_half = trip.domain, trip.opened["time"], trip.half_open["time"]
    others = [g["domain"] for g in groups.values() if t_trip < g["issued_at"] < t_half and g["domain"] != d]
    n = len(others)
    assert n >= 24, f"only {n} groups of the other domains while {d}'s breaker was open"
    weights = {r["domain"]: r["config"]["weight"] for r in h.get(run.url, "/v1/domains") if r["domain"] != d}
    shares = {o: others.count(o) / n for o in weights}
    total = sum(weights.values())
    assert all(abs(shares[o] - w / total) <= share_tolerance(n) for o, w in weights.items()), (shares, n)
    steps = [v for v, (made, _) in h.trained_versions(run.checkpoints).items() if t_trip < made < t_half]
    assert len(steps) >= 3, f"the others trained only {len(steps)} steps while {d}'s breaker was open"
    return {"issued_while_open": n, "shares": {o: round(s, 3) for o, s in shares.items()},
            "steps_while_open": len(steps)}


def _trained_after(run: Run, t: float) -> list[tuple[int, tuple[float, set[str]]]]:
    """The checkpoint store's versions made after ``t``, oldest first."""
    return sorted((v, x) for v, x in h.trained_versions(run.checkpoints).items() if x[0] > t)


def _all_trained(run: Run) -> set[str]:
    return set().union(*(g for _, g in h.trained_versions(run.checkpoints).values()))


def _report(run: Run, domain: str, summary: dict) -> None:
    run.figures.setdefault("summaries", {})[domain] = summary
    print(f"\n[drift] {domain}: {summary}", flush=True)


# ---------------------------------------------------------------- the tests, in order


@pytest.mark.timeout(420)
def test_healthy_baseline_is_diverse_short_and_passes_at_a_moderate_rate(run):
    for d, s in h.DOMAINS.items():  # the taught odds: red (wrong) twice as likely as each other colour
        odds = run.probs[d]
        if s.right:
            assert abs(odds["red"] - 0.4) < 0.05 and all(abs(odds[c] - 0.2) < 0.05 for c in h.MIX if c != "red"), odds
        else:
            assert odds[h.CODE] > 0.8, odds
    rates = _warm(run)
    run.figures["rates"] = rates
    print(f"\n[drift] baseline pass rates {rates}", flush=True)
    for d, s in h.DOMAINS.items():
        p, _ = rates[d]
        assert (0.02 <= p <= 0.5) if s.right else p >= 0.6, (d, p)  # taught: 0.2 and ~0.9; ≥ 48 samples
    assert not [a for a in h.get(run.url, "/v1/alerts", severity="critical")["active"]]
    assert all(h.breaker(run.url, d).get("state", "closed") == "closed" for d in h.DOMAINS)


@pytest.mark.timeout(300)
def test_samples_collapsing_to_one_answer_trip_diversity_collapse(run):
    _warm(run)
    d = "same"
    trip = _trip_and_recover(run, d, lambda: run.patch(d, {"temperature": h.COLD}),
                             lambda: run.patch(d, {"temperature": None}))
    _report(run, d, _check_trip(run, trip, by_issue=True))


@pytest.mark.timeout(300)
def test_completions_growing_to_the_token_budget_trip_truncation_rate(run):
    _warm(run)
    d = "long"
    trip = _trip_and_recover(run, d, lambda: run.patch(d, {"temperature": h.HOT}),
                             lambda: run.patch(d, {"temperature": None}))
    _report(run, d, _check_trip(run, trip, by_issue=True))


@pytest.mark.timeout(300)
def test_a_judge_that_credits_everything_trips_the_judged_domain(run):
    _warm(run)

    def credit(on: bool):
        run.judge.credit_all = on
    trip = _trip_and_recover(run, "judged", lambda: credit(True), lambda: credit(False))
    _report(run, "judged", _check_trip(run, trip, by_issue=False))


@pytest.mark.timeout(420)
def test_a_stopped_sandbox_trips_infra_error_rate_of_the_code_domain(run):
    _warm(run)
    pid = run.sandbox_pid
    trip = _trip_and_recover(run, "code", lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT))
    _report(run, "code", _check_trip(run, trip, by_issue=False))


@pytest.mark.timeout(120)
def test_healthy_domains_raised_no_critical_alert_and_probes_were_never_trained(run):
    assert set(run.trips) == set(h.DOMAINS), f"faults run: {sorted(run.trips)}"
    alerts = h.alerts_topic(run.system)
    crit = [a for a in alerts if a.severity == "critical" and a.status == "firing"]
    for a in crit:  # every critical alert is the faulted domain's, while its fault was on
        trip = run.trips.get(a.domain)
        assert trip is not None and trip.t_fault <= a.time <= trip.opened["time"] + 1.0, a
    assert {a.domain for a in crit if a.signal == "breaker"} == set(h.DOMAINS)
    status = h.get(run.url, "/v1/status")
    assert status["breakers"] == {} and status["alerts"]["critical"] == 0, status["alerts"]
    probes = {g for t in run.trips.values() for g in t.half_open["details"]["probe_groups"]}
    assert not probes & _all_trained(run)
    groups = h.train_groups(run.db)
    last_close = max(t.closed["time"] for t in run.trips.values())
    after = h.pass_rates(groups, since=last_close)
    warned: dict[str, float] = {}
    for a in alerts:
        if a.severity == "warning" and a.status == "firing" and a.value is not None:
            key = f"{a.domain or 'run'}/{a.signal}"
            warned[key] = round(max(warned.get(key, a.value), a.value), 3)
    print(f"\n[drift] alerts on flywheel.alerts: {len(alerts)} ({len(crit)} critical); "
          f"warnings (highest value) {dict(sorted(warned.items()))}; "
          f"pass rates after the last close {after}; summaries {run.figures.get('summaries')}", flush=True)
