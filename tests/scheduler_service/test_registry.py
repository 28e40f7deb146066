"""Registry bookkeeping and the flow-control budget, without a broker."""

from __future__ import annotations

import time

import pytest

from scheduler_service.issue_loop import training_budget
from scheduler_service.registry import Registry, sqlite_path
from scheduler_service.task_store import TaskConflictError
from shared.config import RunConfig
from shared.schemas import RewardEvent, Task


def _task(tid: str, split: str = "train", k: int = 2) -> Task:
    return Task(task_id=tid, domain="toy", prompt=[{"role": "user", "content": f"x {tid}"}],
                verifier={"kind": "exact", "answer": "a"}, samples_per_task=k, split=split)


def _ev(group_id: str, i: int, passed: bool = True, traj: str | None = None, infra: bool = False,
        purpose: str = "train", v: int = 0) -> RewardEvent:
    return RewardEvent(task_id=group_id.rsplit(":", 1)[0], group_id=group_id, trajectory_id=traj or f"{group_id}:{i}",
                       sample_index=i, group_size=2, domain="toy", difficulty=0.0, purpose=purpose,
                       reward=float(passed), passed=passed, infra_error=infra, completion_tokens=3,
                       finish_reason="stop", policy_version=v)


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "r.db")
    yield r
    r.close()


def test_sqlite_url_resolves_under_run_dir(tmp_path):
    run = RunConfig(dir=str(tmp_path))
    assert sqlite_path("sqlite:///x.db", run) == tmp_path.resolve() / "x.db"
    assert sqlite_path(f"sqlite:///{tmp_path}/abs.db", run) == tmp_path / "abs.db"
    with pytest.raises(ValueError, match="sqlite"):
        sqlite_path("postgresql://h/db", run)


def test_conflict_rolls_back_the_whole_batch(reg):
    reg.register_tasks([_task("a")])
    with pytest.raises(TaskConflictError) as e:
        reg.register_tasks([_task("b"), _task("a", k=4)])
    assert e.value.task_ids == ["a"] and reg.get_task("b") is None
    assert reg.register_tasks([_task("a"), _task("b")]) == ["a", "b"]


def test_rewards_are_counted_once_and_complete_the_group(reg):
    reg.register_tasks([_task("t")])
    (g,) = reg.issue_train_groups(["t"], deadline_s=60)
    assert g.group_id == "t:0" and g.n == 2
    assert reg.record_reward(_ev("t:0", 0, passed=True)).counted
    assert not reg.record_reward(_ev("t:0", 0, passed=True)).new  # redelivery
    assert not reg.record_reward(_ev("t:0", 0, traj="other")).counted  # same sample index, other attempt
    assert not reg.record_reward(_ev("zzz:0", 0)).new  # unknown group
    out = reg.record_reward(_ev("t:0", 1, passed=False, infra=True))
    assert out.counted and out.completed and not out.scored
    assert reg.get_group("t:0")["state"] == "complete"
    assert reg.get_task("t") | {} == {"task_id": "t", "domain": "toy", "split": "train", "state": "active",
                                      "samples": 1, "passes": 1, "pass_rate": 1.0, "groups_issued": 1}
    assert reg.train_group_counts() == (1, 0)


def test_expired_groups_are_reissued_then_abandoned(reg):
    reg.register_tasks([_task("t")])
    reg.issue_train_groups(["t"], deadline_s=0.0)
    time.sleep(0.01)
    again, gone = reg.expire_groups(deadline_s=0.0, max_attempts=2)
    assert [(g.group_id, g.attempt) for g in again] == [("t:0", 2)] and gone == []
    time.sleep(0.01)
    again, gone = reg.expire_groups(deadline_s=0.0, max_attempts=2)
    assert again == [] and gone == ["t:0"]
    assert reg.group_state_counts()["abandoned"] == 1
    assert reg.train_group_counts() == (0, 0)  # an abandoned group gives its slot back


def test_eval_round_accuracy_and_versions(reg):
    reg.register_tasks([_task("e1", "eval"), _task("e2", "eval"), _task("tr")])
    rid = reg.create_eval_round(min_policy_version=3)
    assert rid == 0 and reg.create_eval_round(3) == 1
    groups = reg.take_pending(deadline_s=60)
    r0 = [g for g in groups if g.eval_round == 0]
    assert sorted(g.task.task_id for g in r0) == ["e1", "e2"]
    assert all(g.n == 1 and g.purpose == "eval" and g.min_policy_version == 3 for g in r0)
    assert reg.eval_round(0)["done"] is False
    reg.record_reward(_ev(r0[0].group_id, 0, passed=True, purpose="eval", v=4))
    reg.record_reward(_ev(r0[1].group_id, 0, passed=False, purpose="eval", v=3))
    s = reg.eval_round(0)
    assert (s["n"], s["completed"], s["correct"], s["accuracy"], s["policy_versions"], s["done"]) == (
        2, 2, 1, 0.5, [3, 4], True)
    assert reg.eval_round(1)["done"] is False and reg.eval_round(1)["accuracy"] is None


def test_policy_version_only_rises_and_persists(tmp_path):
    r = Registry(tmp_path / "p.db")
    assert r.policy_version == 0
    assert r.raise_policy_version(3) and not r.raise_policy_version(2)
    r.close()
    r = Registry(tmp_path / "p.db")
    assert r.policy_version == 3
    r.close()


@pytest.mark.parametrize(
    "v, b, eta, steps, issued, flight, want",
    [
        (0, 1, 0, 30, 0, 0, 1),   # (0 + 0 + 1) * 1
        (0, 1, 0, 30, 1, 0, 0),   # total cap reached until v rises
        (1, 1, 0, 30, 1, 0, 1),
        (0, 4, 1, 30, 0, 0, 8),   # (η + 1) * B in flight
        (5, 4, 1, 30, 20, 6, 2),  # in-flight cap binds
        (29, 2, 1, 30, 58, 0, 2),  # max_steps caps the total: 30 * 2
        (30, 2, 1, 30, 60, 0, 0),
    ],
)
def test_training_budget(v, b, eta, steps, issued, flight, want):
    assert training_budget(v, b, eta, steps, issued, flight) == want


def test_learnable_tasks_are_partly_solved_and_not_in_flight(reg):
    reg.register_tasks([_task(t) for t in ("solved", "unsolved", "half", "busy", "unseen")])
    for tid, results in (("solved", [True, True]), ("unsolved", [False, False]), ("half", [True, False]),
                         ("busy", [False, True])):
        (g,) = reg.issue_train_groups([tid], deadline_s=60)
        for i, passed in enumerate(results):
            reg.record_reward(_ev(g.group_id, i, passed=passed))
    reg.issue_train_groups(["busy"], deadline_s=60)  # a second group of "busy" is in flight
    assert reg.learnable_train_tasks() == [("half", 0.5)]


def test_learnability_curriculum_replays_at_most_its_share_of_partly_solved_tasks(reg):
    from scheduler_service.config import SchedulerSettings
    from scheduler_service.sampler import Sampler
    from scheduler_service.stats import Stats

    cfg = SchedulerSettings(scheduler={"curriculum": "learnability", "replay_fraction": 0.5})
    reg.register_tasks([_task(f"t{i}") for i in range(6)])
    for i in range(6):
        (g,) = reg.issue_train_groups([f"t{i}"], deadline_s=60)
        for j, passed in enumerate([i < 3, False]):  # t0-t2 half solved, t3-t5 unsolved
            reg.record_reward(_ev(g.group_id, j, passed=passed))
    sampler = Sampler(cfg, reg, producer=None, stats=Stats(60.0, 16))
    picks = sampler._learnable(4)
    assert len(picks) == 2 and set(picks) <= {"t0", "t1", "t2"} and len(set(picks)) == 2
    assert len(sampler._learnable(6)) == 3  # never more than there are


def test_a_paused_domain_gets_no_training_groups_until_resumed(reg):
    ok = Task(task_id="ok", domain="good", prompt=[{"role": "user", "content": "x"}],
              verifier={"kind": "exact", "answer": "a"})
    bad = Task(task_id="bad", domain="broken", prompt=[{"role": "user", "content": "x"}],
               verifier={"kind": "exact", "answer": "a"})
    reg.register_tasks([ok, bad])
    assert reg.least_issued_train_tasks() == ["bad", "ok"]
    assert reg.pause_domain("broken", "gold answer does not parse", "bad")
    assert not reg.pause_domain("broken", "again", "bad")  # paused once, first reason kept
    assert reg.paused_domains()["broken"]["reason"] == "gold answer does not parse"
    assert reg.least_issued_train_tasks() == ["ok"]
    reg.issue_train_groups(["ok"], deadline_s=60)
    assert reg.least_issued_train_tasks() == ["ok"]  # the fewest groups among unpaused domains
    assert reg.resume_domain("broken") and not reg.resume_domain("broken")
    assert reg.least_issued_train_tasks() == ["bad"] and reg.paused_domains() == {}


def _ev_n(group_id: str, i: int, n: int, reward: float = 0.0, passed: bool = False, infra: bool = False) -> RewardEvent:
    return _ev(group_id, i, passed=passed, infra=infra).model_copy(update={"group_size": n, "reward": reward})


def test_an_unsolved_group_is_resampled_once_with_more_samples(reg):
    reg.register_tasks([_task(t) for t in ("zero", "half", "flaky", "diff")])
    groups = {t: reg.issue_train_groups([t], deadline_s=60)[0].group_id for t in ("zero", "half", "flaky", "diff")}
    assert reg.train_group_counts() == (4, 4)
    # unsolved: no pass, equal rewards -> one extra group of 6 samples, written with the completing event
    assert reg.record_reward(_ev_n(groups["zero"], 0, 2), resample_n=6).resample is None  # not complete yet
    out = reg.record_reward(_ev_n(groups["zero"], 1, 2), resample_n=6)
    assert out.completed and out.resample is not None
    assert (out.resample.group_id, out.resample.n, out.resample.purpose, out.resample.attempt) == ("zero:1", 6,
                                                                                                     "train", 1)
    row = reg.get_group("zero:1")
    assert (row["state"], row["n"], row["resample_of"]) == ("pending", 6, "zero:0")
    (sent,) = reg.take_pending(deadline_s=60)  # the sampler's issue loop sends it
    assert (sent.group_id, sent.n) == ("zero:1", 6) and reg.get_group("zero:1")["state"] == "issued"
    assert reg.train_group_counts() == (4, 4)  # an extra group: not in the issue budget, but in flight
    # a redelivered completing event re-samples nothing
    assert reg.record_reward(_ev_n(groups["zero"], 1, 2), resample_n=6).resample is None
    # the re-sample itself is never re-sampled, even when unsolved
    for i in range(6):
        assert reg.record_reward(_ev_n("zero:1", i, 6), resample_n=6).resample is None
    assert reg.get_group("zero:1")["state"] == "complete" and reg.get_task("zero")["samples"] == 8
    # a pass, an infrastructure error or unequal rewards (advantages not all 0): no re-sample
    reg.record_reward(_ev_n(groups["half"], 0, 2, reward=1.0, passed=True), resample_n=6)
    assert reg.record_reward(_ev_n(groups["half"], 1, 2), resample_n=6).resample is None
    reg.record_reward(_ev_n(groups["flaky"], 0, 2, infra=True), resample_n=6)
    assert reg.record_reward(_ev_n(groups["flaky"], 1, 2), resample_n=6).resample is None
    reg.record_reward(_ev_n(groups["diff"], 0, 2, reward=0.3), resample_n=6)
    assert reg.record_reward(_ev_n(groups["diff"], 1, 2), resample_n=6).resample is None


def test_no_resample_when_off_or_not_larger(reg):
    reg.register_tasks([_task(t) for t in ("a", "b", "c")])
    for t in ("a", "b", "c"):
        reg.issue_train_groups([t], deadline_s=60)
    reg.record_reward(_ev_n("a:0", 0, 2))
    assert reg.record_reward(_ev_n("a:0", 1, 2), resample_n=0).resample is None  # off
    reg.record_reward(_ev_n("b:0", 0, 2))
    assert reg.record_reward(_ev_n("b:0", 1, 2), resample_n=2).resample is None  # not larger than the group
    assert reg.pause_domain("toy", "broken", "c")
    reg.record_reward(_ev_n("c:0", 0, 2))
    # even in a paused domain: the trainer has set the unsolved group aside and waits for its place-taker
    assert reg.record_reward(_ev_n("c:0", 1, 2), resample_n=6).resample.n == 6
    assert reg.train_group_counts() == (3, 0)  # the re-sample is pending, not yet in flight


def test_a_registry_from_before_resampling_and_drops_gains_the_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    old = Registry(path)
    old.close()
    db = sqlite3.connect(path)
    db.execute('ALTER TABLE "groups" DROP COLUMN resample_of')
    db.execute('ALTER TABLE "groups" DROP COLUMN dropped')
    db.commit()
    db.close()
    reg = Registry(path)
    try:
        reg.register_tasks([_task("t")])
        reg.issue_train_groups(["t"], deadline_s=60)
        reg.record_reward(_ev_n("t:0", 0, 2))
        assert reg.record_reward(_ev_n("t:0", 1, 2), resample_n=4).resample.n == 4
        assert reg.record_drop("t:1", "stale") == "t:0"
    finally:
        reg.close()


def test_a_dropped_group_gives_its_slot_back_once(reg):
    """Stale and failed drops free the slot (and the in-flight place) of the group; a repeated,
    unknown or eval-group notice changes nothing; a dropped group is never re-issued past its
    deadline."""
    reg.register_tasks([_task(t) for t in ("a", "b", "c")] + [_task("e", split="eval")])
    for t in ("a", "b", "c"):
        reg.issue_train_groups([t], deadline_s=0.0)  # past their deadline at once
    reg.record_reward(_ev_n("a:0", 0, 2, reward=1.0, passed=True))
    reg.record_reward(_ev_n("a:0", 1, 2))
    assert reg.train_group_counts() == (3, 2)
    assert reg.record_drop("a:0", "stale") == "a:0"
    assert reg.train_group_counts() == (2, 2)
    assert reg.record_drop("a:0", "stale") is None and reg.record_drop("a:0", "failed") is None
    assert reg.record_drop("zzz:0", "stale") is None
    assert reg.record_drop("b:0", "failed") == "b:0"  # still in flight: no longer counted there either
    assert reg.train_group_counts() == (1, 1) and reg.dropped_counts() == {"stale": 1, "failed": 1}
    rid = reg.create_eval_round(0)
    assert rid == 0 and reg.record_drop("e:0", "stale") is None  # eval groups hold no training slot
    time.sleep(0.01)
    reissued, abandoned = reg.expire_groups(deadline_s=60, max_attempts=3)
    assert [g.group_id for g in reissued] == ["c:0"] and abandoned == []
    assert reg.get_group("b:0")["state"] == "abandoned"  # dropped: nothing to wait for, never re-issued


def test_a_superseded_unsolved_group_keeps_its_slot_only_while_a_resample_holds_it(reg):
    reg.register_tasks([_task(t) for t in ("u", "v")])
    for t in ("u", "v"):
        reg.issue_train_groups([t], deadline_s=60)
    for g in ("u:0", "v:0"):
        reg.record_reward(_ev_n(g, 0, 2))
    assert reg.record_reward(_ev_n("u:0", 1, 2), resample_n=6).resample.group_id == "u:1"
    # the trainer set u:0 aside for its re-sample: the re-sample holds the slot
    assert reg.record_drop("u:0", "superseded_unsolved") is None and reg.train_group_counts()[0] == 2
    # ... and when the re-sample goes stale, the original's slot comes back
    assert reg.record_drop("u:1", "stale") == "u:0"
    assert reg.train_group_counts()[0] == 1 and reg.get_group("u:0")["dropped"] == "resample_stale"
    # set aside, but the scheduler wrote no re-sample (its test disagreed, or it was off): the slot comes back,
    # and a completing event that arrives after the drop writes none (the slot already went to a new group)
    assert reg.record_drop("v:0", "superseded_unsolved") == "v:0"
    assert reg.record_reward(_ev_n("v:0", 1, 2), resample_n=6).resample is None
    assert reg.train_group_counts()[0] == 0


def test_an_unsolved_resample_gives_its_originals_slot_back(reg):
    """The trainer drops a re-sample that came back unsolved too (``unsolved``: all advantages 0): the original's
    slot comes back, so the scheduler issues another group in its place."""
    reg.register_tasks([_task("w")])
    reg.issue_train_groups(["w"], deadline_s=60)
    reg.record_reward(_ev_n("w:0", 0, 2))
    assert reg.record_reward(_ev_n("w:0", 1, 2), resample_n=6).resample.group_id == "w:1"
    assert reg.record_drop("w:0", "superseded_unsolved") is None and reg.train_group_counts()[0] == 1
    assert reg.record_drop("w:1", "unsolved") == "w:0"
    assert reg.train_group_counts()[0] == 0 and reg.get_group("w:0")["dropped"] == "resample_unsolved"
    assert reg.dropped_counts() == {"unsolved": 1, "resample_unsolved": 1}
