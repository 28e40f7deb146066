"""A run that cannot go on says so: the planner names each domain's reason when no domain can issue training work
(every task retired, paused, over budget, a generator that ran dry), says nothing while a domain only waits (its
breaker's probe, a generator making tasks), and the watch raises one critical ``run/stalled`` alert after
``scheduler.stall_after_s`` and resolves it when work comes back."""

from __future__ import annotations

from scheduler_service.config import DomainConfig, SchedulerSettings
from scheduler_service.issuing import IssuePlanner
from scheduler_service.stall import StallWatch

from .test_domains import _complete, _issue, _task, reg  # noqa: F401 - reg is a fixture


def test_every_task_retired_paused_and_over_budget_are_named(reg):  # noqa: F811
    reg.put_domain("easy", DomainConfig(lifecycle={"retire_after": 1}))
    reg.put_domain("off", DomainConfig(state="paused"))
    reg.put_domain("capped", DomainConfig(budget={"samples": 2}))
    reg.register([_task(f"e{i}", "easy") for i in range(2)] + [_task("o0", "off"), _task("c0", "capped")])
    planner = IssuePlanner(SchedulerSettings(), reg)
    for _ in range(3):
        _complete(reg, _issue(reg, planner, 4), passed=lambda g, i: True)  # every sample passes: retired
    assert planner.plan(4) == []
    why = planner.stall_reasons()
    assert why is not None and set(why) == {"easy", "off", "capped"}, why
    assert why["easy"].startswith("no live training task at level 0 (2 of 2 retired")
    assert why["off"] == "paused" and why["capped"].startswith("over budget (samples 2 of 2")
    # a domain that only waits (its breaker is open: a probe decides) is not a stall
    planner.blocked.add("easy")
    assert planner.stall_reasons() is None
    planner.blocked.discard("easy")
    # neither is a generator that can still make tasks
    assert planner.stall_reasons(making={"easy"}) is None
    # new work: nothing to report
    reg.register([_task("e9", "easy")])
    assert planner.plan(4) and planner.stall_reasons() is None


def test_the_watch_alerts_once_after_the_grace_and_resolves_when_work_returns():
    t = [0.0]
    watch = StallWatch(after_s=30, clock=lambda: t[0])
    why = {"a": "no live training task at level 0 (4 of 4 retired)", "b": "paused"}
    assert watch.observe(why, 3) == [] and watch.public() is None
    t[0] = 29.0
    assert watch.observe(why, 3) == []
    t[0] = 30.0
    (fired,) = watch.observe(why, 3)
    assert (fired.key, fired.status, fired.severity) == ("run/stalled", "firing", "critical")
    assert "a: no live training task" in fired.message and "b: paused" in fired.message
    assert fired.details["domains"] == why
    assert watch.observe(why, 3) == []  # once
    assert watch.public()["domains"] == why and "cannot go on" in watch.public()["message"]
    (resolved,) = watch.observe(None, 4)
    assert resolved.status == "resolved" and watch.public() is None
    assert watch.observe(None, 4) == []
