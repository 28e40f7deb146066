"""Per-domain step metrics, computed by hand for two domains."""

from __future__ import annotations

import pytest

from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory
from trainer_service.domain_metrics import domain_metrics
from trainer_service.groups import Group


def _group(gid: str, domain: str, rows: list[tuple[float, int, str, int]]) -> Group:
    """``rows``: (reward, completion tokens, finish reason, behaviour version) per sample."""
    task = Task(task_id=gid, domain=domain, prompt=[{"role": "user", "content": "q"}],
                verifier={"kind": "regex", "pattern": "^a"}, samples_per_task=len(rows))
    g = Group(gid, len(rows))
    for i, (reward, n, finish, v) in enumerate(rows):
        tr = Trajectory(trajectory_id=f"{gid}:{i}", group_id=gid, sample_index=i, group_size=len(rows), task=task,
                        prompt_ids=[1], completion_ids=[7] * n, completion_logprobs=[-1.0] * n, loss_mask=[1] * n,
                        completion_text="x", finish_reason=finish,
                        policy_versions=[{"version": v, "start": 0, "end": n}])
        g.samples[i] = ScoredTrajectory(trajectory=tr, reward=Reward(total=reward))
    return g


def test_two_domains_each_get_their_own_means():
    groups = [_group("a1", "toy", [(1.0, 4, "stop", 4), (0.0, 2, "length", 3)]),
              _group("a2", "toy", [(0.0, 6, "length", 4), (0.0, 4, "stop", 4)]),  # zero variance
              _group("b1", "code", [(0.5, 10, "stop", 2), (1.0, 20, "stop", 2)])]
    got = domain_metrics(groups, version=5)  # the step trained from version 4
    assert list(got) == ["code", "toy"]
    assert got["toy"] == {
        "train/groups": 2.0, "train/samples": 4.0, "train/reward_mean": 0.25, "train/pass_rate": 0.25,
        "train/completion_tokens_mean": 4.0, "train/truncated_frac": 0.5, "train/zero_variance_groups": 1.0,
        "train/staleness_mean": 0.25, "train/staleness_max": 1.0}
    assert got["code"]["train/reward_mean"] == pytest.approx(0.75) and got["code"]["train/pass_rate"] == 0.5
    assert got["code"]["train/completion_tokens_mean"] == 15.0 and got["code"]["train/staleness_mean"] == 2.0
    assert domain_metrics([], version=1) == {} and domain_metrics([Group("e", 2)], version=1) == {}
