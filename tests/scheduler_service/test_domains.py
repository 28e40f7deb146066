"""Domains in the registry and the planner: mix shares, pause and weight changes, adaptive samples,
curriculum levels, task lifecycle, duplicates, budgets; without a broker (the REST tests below use the
app without Kafka)."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler_service.config import AdaptiveSamples, DomainConfig, SchedulerSettings
from scheduler_service.domains import content_key, samples_for
from scheduler_service.issuing import IssuePlanner, TaskMaker
from scheduler_service.mix import StrideMix
from scheduler_service.registry import Registry
from shared.schemas import RewardEvent, Task


def _task(tid: str, domain: str, difficulty: float = 0.0, k: int = 2, prompt: str | None = None) -> Task:
    return Task(task_id=tid, domain=domain, prompt=[{"role": "user", "content": prompt or f"q {tid}"}],
                verifier={"kind": "exact", "answer": "a"}, samples_per_task=k, difficulty=difficulty)


def _ev(group_id: str, task_id: str, domain: str, i: int, n: int, passed: bool, tokens: int = 5,
        cost: dict | None = None) -> RewardEvent:
    return RewardEvent(task_id=task_id, group_id=group_id, trajectory_id=f"{group_id}:{i}", sample_index=i,
                       group_size=n, domain=domain, difficulty=0.0, purpose="train", reward=float(passed),
                       passed=passed, completion_tokens=tokens, finish_reason="stop", policy_version=0,
                       cost=cost or {})


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "r.db")
    yield r
    r.close()


def _issue(reg: Registry, planner: IssuePlanner, budget: int):
    return reg.issue_train_groups(planner.plan(budget), deadline_s=60)


def _complete(reg: Registry, groups, passed=lambda g, i: False, cost: dict | None = None) -> None:
    for g in groups:
        for i in range(g.n):
            reg.record_reward(_ev(g.group_id, g.task.task_id, g.task.domain, i, g.n, passed(g, i), cost=cost))


# ---------------------------------------------------------------- the mix


def test_stride_mix_is_exact_over_short_windows_and_pause_and_weights_shift_at_once():
    mix = StrideMix(lookahead=4)
    weights = {"a": 3.0, "b": 1.0, "c": 1.0}
    mix.set_weights(weights)
    picks = []
    for _ in range(50):
        d = mix.choose(weights)
        mix.take(d, weights)
        picks.append(d)
    for window in (picks[:10], picks[10:30], picks):
        c = Counter(window)
        for d, w in weights.items():  # within one group of the exact share over any window
            assert abs(c[d] - len(window) * w / 5) <= 1.0, (window, c)
    eligible = {"a": 3.0, "c": 1.0}  # b paused: its share goes to the others in proportion
    after = []
    for _ in range(40):
        d = mix.choose(eligible)
        mix.take(d, eligible)
        after.append(d)
    assert Counter(after) == {"a": 30, "c": 10}
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}  # b back, a's weight lowered: no burst for b
    mix.set_weights(weights)
    back = []
    for _ in range(30):
        d = mix.choose(weights)
        mix.take(d, weights)
        back.append(d)
    assert Counter(back[:3]) == {"a": 1, "b": 1, "c": 1} and Counter(back) == {"a": 10, "b": 10, "c": 10}


def test_cost_order_starts_slow_domains_first_and_starves_none():
    mix = StrideMix(lookahead=3)
    weights = {"fast": 1.0, "slow": 1.0}
    mix.set_weights(weights)
    cost = {"fast": 0.01, "slow": 5.0}
    picks = []
    for _ in range(40):
        d = mix.choose(weights, cost)
        mix.take(d, weights)
        picks.append(d)
    assert picks[0] == "slow"
    c = Counter(picks)
    assert abs(c["slow"] - c["fast"]) <= mix.lookahead + 1  # the drift the cost order may add
    longest = max(len(run) for run in "".join("s" if p == "slow" else "f" for p in picks).split("s"))
    assert longest <= 3  # the fast domain is never passed over more than `lookahead` times


def test_shares_follow_weights_over_many_domains_and_a_pause_and_a_weight_change_shift_them(reg):
    names = [f"d{i:03d}" for i in range(100)]
    weights = {d: (3.0 if i % 10 == 0 else 1.0) for i, d in enumerate(names)}
    reg.register([_task(f"{d}-t{j}", d) for d in names for j in range(3)])
    for d, w in weights.items():
        reg.put_domain(d, DomainConfig(weight=w))
    planner = IssuePlanner(SchedulerSettings(scheduler={"issue_order": "fifo"}), reg)
    issued = []
    while len(issued) < 500:
        groups = _issue(reg, planner, 7)
        _complete(reg, groups)
        issued += [g.task.domain for g in groups]
    c, total = Counter(issued[:500]), sum(weights.values())
    assert set(c) == set(names)  # every domain issued
    assert max(abs(c[d] / 500 - w / total) for d, w in weights.items()) <= 0.02
    reg.put_domain("d000", DomainConfig(weight=30.0))  # over REST this is PATCH {"weight": 30}
    reg.put_domain("d010", DomainConfig(weight=3.0, state="paused"))
    nxt = []
    while len(nxt) < 50:
        groups = _issue(reg, planner, 5)
        _complete(reg, groups)
        nxt += [g.task.domain for g in groups]
    c = Counter(nxt[:50])
    assert c["d010"] == 0
    total = total - 3.0 - 3.0 + 30.0
    assert abs(c["d000"] - 50 * 30.0 / total) <= 1.0  # 11-12 of 50 at once, not spread over many windows


# ---------------------------------------------------------------- samples, curriculum, lifecycle


@pytest.mark.parametrize("samples, passes, want", [(0, 0, 16), (8, 0, 16), (8, 8, 2), (8, 4, 2), (16, 2, 6),
                                                   (64, 1, 16)])
def test_adaptive_samples_give_hard_and_unknown_tasks_more(samples, passes, want):
    assert samples_for(samples, passes, AdaptiveSamples(min=2, max=16, target=0.5)) == want


def test_planner_uses_adaptive_samples_and_the_domain_k(reg):
    reg.register([_task("new", "ad"), _task("easy", "ad"), _task("k", "fixed")])
    reg.put_domain("ad", DomainConfig(adaptive_samples={"min": 2, "max": 12}))
    reg.put_domain("fixed", DomainConfig(samples_per_task=6))
    planner = IssuePlanner(SchedulerSettings(), reg)
    n = {g.task.task_id: g.n for g in _issue(reg, planner, 3)}
    assert n == {"new": 12, "easy": 12, "k": 6}


def test_adaptive_curriculum_promotes_with_hysteresis_and_demotes(reg):
    levels = [{"difficulty": [0, 0]}, {"difficulty": [1, 1]}]
    cfg = DomainConfig(levels=levels, curriculum={"mode": "adaptive", "promote_above": 0.8, "demote_below": 0.2,
                                                  "window": 4, "min_samples": 6})
    reg.put_domain("c", cfg)
    reg.register([_task(f"e{i}", "c", 0.0) for i in range(4)] + [_task(f"h{i}", "c", 1.0) for i in range(4)])
    planner = IssuePlanner(SchedulerSettings(), reg)
    groups = _issue(reg, planner, 2)
    assert {g.task.task_id[0] for g in groups} == {"e"}  # level 0 issues only level-0 tasks
    _complete(reg, groups[:1], passed=lambda g, i: True)  # 2 passing samples: not enough to move yet
    assert reg.domain("c").config.level == 0 and reg.domain("c").level_samples == 2
    _complete(reg, groups[1:], passed=lambda g, i: True)
    more = _issue(reg, planner, 1)
    _complete(reg, more, passed=lambda g, i: True)  # the 6th passing sample promotes
    row = reg.domain("c")
    assert row.config.level == 1 and row.level_samples == 0 and row.recent_pass is None
    assert {g.task.task_id[0] for g in _issue(reg, planner, 4)} == {"h"}
    late = [g for g in reg.issue_train_groups(["e0"], deadline_s=60)]
    _complete(reg, late)  # a level-0 group finishing after the move does not count for level 1
    assert reg.domain("c").level_samples == 0
    # and its samples say so to the drift monitor: the level their task was issued at, not the domain's
    straggler = reg.issue_train_groups(["e1"], deadline_s=60)[0]
    outcome = reg.record_reward(_ev(straggler.group_id, "e1", "c", 0, straggler.n, True))
    assert outcome.counted and outcome.level == 0 and reg.domain("c").config.level == 1
    hard = _issue(reg, planner, 4)
    _complete(reg, hard)  # 8 failing samples of level 1: demoted
    assert reg.domain("c").config.level == 0
    kinds = [e["kind"] for e in reg.domain_events("c")]
    assert kinds.count("promoted") == 1 and kinds.count("demoted") == 1


def test_saturated_tasks_retire_and_never_solved_ones_are_flagged(reg):
    reg.put_domain("life", DomainConfig(lifecycle={"retire_after": 2, "flag_after": 3}))
    reg.register([_task("easy", "life"), _task("hard", "life"), _task("mixed", "life")])
    outcome = {"easy": lambda i: True, "hard": lambda i: False, "mixed": lambda i: i == 0}
    planner = IssuePlanner(SchedulerSettings(), reg)
    for _ in range(3):
        _complete(reg, _issue(reg, planner, 3), passed=lambda g, i: outcome[g.task.task_id](i))
    assert reg.get_task("easy")["state"] == "retired"
    assert reg.get_task("hard")["flagged"] is True and reg.get_task("hard")["state"] == "active"
    assert "flagged" not in reg.get_task("mixed")
    assert {g.task.task_id for g in _issue(reg, planner, 5)} == {"hard", "mixed"}  # easy is out of training
    s = reg.task_summary()["life"]
    assert (s["retired"], s["flagged"]) == (1, 1)
    assert reg.task_list("life", "retired") == ["easy"] and reg.task_list("life", "flagged") == ["hard"]


def test_identical_tasks_are_stored_once_and_reported(reg):
    a = _task("a", "dup", prompt="What is  2+2?")
    b = _task("b", "dup", prompt="what is 2+2? ")  # same after normalising case and whitespace
    c = _task("c", "other", prompt="What is 2+2?")  # another domain: not a duplicate
    out = reg.register([a, b, c])
    assert out.duplicates == [("b", "a")] and [t.task_id for t in out.new] == ["a", "c"]
    assert out.task_ids == ["a", "a", "c"]
    assert content_key(a) == content_key(b) != content_key(c)
    again = reg.register([_task("z", "dup", prompt="WHAT IS 2+2?")])
    assert again.duplicates == [("z", "a")] and not again.new
    assert reg.get_task("z")["task_id"] == "a" and reg.get_task("z")["duplicate_of"] == "a"
    assert reg.task_counts()["train"] == 2 and reg.task_summary()["dup"]["duplicates"] == 2


def test_a_sample_budget_stops_a_domain_and_its_share_goes_to_the_others(reg):
    reg.register([_task(f"{d}{i}", d) for d in ("cap", "free") for i in range(20)])
    reg.put_domain("cap", DomainConfig(budget={"samples": 8}))
    planner = IssuePlanner(SchedulerSettings(), reg)
    issued = []
    for _ in range(10):
        groups = _issue(reg, planner, 2)
        _complete(reg, groups, cost={"generated_tokens": 7.0, "tool_seconds": 0.5})
        issued += [g.task.domain for g in groups]
    assert Counter(issued) == {"cap": 4, "free": 16}  # 4 groups of 2 samples, then only "free"
    assert planner.over_budget == {"cap": "samples 8 of 8"}
    spend = reg.spend()["cap"]["train"]
    assert (spend["samples"], spend["generated_tokens"], spend["tool_seconds"], spend["groups"]) == (8, 56.0, 4.0, 4)


# ---------------------------------------------------------------- generators


def test_generator_domains_make_tasks_per_level_and_stop_when_dry(reg):
    cfg = DomainConfig(generator="tests.support.generators:make", tasks_per_level=5, eval_size=3,
                       levels=[{"params": {"digits": 1}}, {"params": {"digits": 3, "limit": 2}}])
    reg.put_domain("gen", cfg)
    maker = TaskMaker(SchedulerSettings(), reg)
    row = reg.domain("gen")
    assert maker.needs(row, starved=True) == [("eval", 0), ("train", 0)]
    made = [t for split, lv in maker.needs(row, True) for t in maker.make(row, split, lv)]
    assert Counter(t.split for t in made) == {"eval": 3, "train": 5}
    assert all(t.domain == "gen" and t.task_id.startswith("gen.") for t in made)
    row = reg.domain("gen")
    assert maker.needs(row, starved=False) == []  # held-out set made once; level 0 has live tasks
    reg.put_domain("gen", cfg.model_copy(update={"level": 1}))
    row = reg.domain("gen")
    assert len(maker.make(row, "train", 1)) == 2  # this level has only 2 distinct prompts
    assert maker.make(reg.domain("gen"), "train", 1) == []  # nothing new: the level is dry
    assert maker.needs(reg.domain("gen"), starved=True) == []
    assert reg.get_task(made[-1].task_id)["split"] == "train"


def test_a_domain_with_few_tasks_still_gets_its_share(reg):
    reg.register([_task("only", "small")] + [_task(f"m{i}", "big") for i in range(20)])
    reg.put_domain("small", DomainConfig(weight=3.0))
    planner = IssuePlanner(SchedulerSettings(scheduler={"issue_order": "fifo"}), reg)
    groups = _issue(reg, planner, 8)
    assert Counter(g.task.domain for g in groups) == {"small": 6, "big": 2}
    assert len({g.group_id for g in groups}) == 8  # the one task's groups are distinct groups


def _registry_state(reg: Registry) -> dict:
    """Everything a reward writes, by table (times left out)."""
    with reg._lock:
        db = reg._db
        return {
            "groups": [tuple(r) for r in db.execute(
                'SELECT group_id, state, received, n, resample_of FROM "groups" ORDER BY group_id')],
            "rewards": [tuple(r) for r in db.execute(
                "SELECT trajectory_id, counted, passed FROM rewards ORDER BY trajectory_id")],
            "tasks": [tuple(r) for r in db.execute(
                "SELECT task_id, samples, passes, pass_streak, groups_done, retired, flagged FROM tasks ORDER BY task_id")],
            "domains": [tuple(r) for r in db.execute(
                "SELECT domain, config, recent_pass, level_samples FROM domains ORDER BY domain")],
            "spend": [tuple(r) for r in db.execute("SELECT domain, purpose, samples, groups FROM spend ORDER BY domain")],
            "events": [tuple(r) for r in db.execute("SELECT domain, kind, detail FROM domain_events ORDER BY id")],
        }


def test_a_batch_of_rewards_in_one_transaction_records_what_one_at_a_time_does(tmp_path):
    """``record_rewards`` (one transaction per polled batch) against ``record_reward`` per event on a twin
    registry: the same outcomes and the same rows, with the curriculum window moving many times within the
    batch (a promotion, then samples counted at the new level), redeliveries, an infrastructure error and an
    unsolved group that re-samples."""
    levels = [{"difficulty": [0, 0]}, {"difficulty": [1, 1]}]
    cfg = DomainConfig(levels=levels, curriculum={"mode": "adaptive", "promote_above": 0.7, "demote_below": 0.1,
                                                  "window": 4, "min_samples": 6},
                       lifecycle={"retire_after": 2, "flag_after": 2})
    regs = [Registry(tmp_path / f"{name}.db") for name in ("one", "batch")]
    try:
        issued = []
        for reg in regs:
            reg.put_domain("c", cfg)
            reg.register([_task(f"e{i}", "c", 0.0, k=4) for i in range(4)] + [_task(f"h{i}", "c", 1.0, k=4)
                                                                            for i in range(2)])
            issued.append(reg.issue_train_groups(["e0", "e1", "e2", "h0", "h1"], deadline_s=60))
        assert [g.group_id for g in issued[0]] == [g.group_id for g in issued[1]]
        events = []
        for g in issued[0]:
            for i in range(g.n):
                passed = g.task.task_id in ("e0", "e1") or (g.task.task_id == "h0" and i % 2 == 0)
                ev = _ev(g.group_id, g.task.task_id, "c", i, g.n, passed)
                if g.task.task_id == "e2" and i == 1:
                    ev = ev.model_copy(update={"infra_error": True, "passed": False, "reward": 0.0})
                events.append(ev)
        events[3:3] = [events[0], events[1]]  # redelivered within the batch
        events.append(events[-1])  # and at its end
        one = [regs[0].record_reward(ev, resample_n=8) for ev in events]
        batch = regs[1].record_rewards(events, resample_n=8)
        assert batch == one
        assert any(o.resample is not None for o in one)  # h1: nothing passed, all rewards equal
        moved = _registry_state(regs[0])
        assert [e[1] for e in moved["events"]] == ["promoted", "demoted"]  # the level moved twice within the batch
        assert _registry_state(regs[1]) == moved
        assert regs[1].domain("c") == regs[0].domain("c")  # the cached rows too
    finally:
        for reg in regs:
            reg.close()
