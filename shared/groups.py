"""The one rule for an *unsolved* group, called by both the scheduler and the trainer.

With ``budget.resample_unsolved`` = N > 0, a training group of K < N samples that comes back
unsolved is replaced by one re-sample of N samples of the same task: the scheduler writes the
re-sample when the group completes (``scheduler_service.registry.Registry.record_reward``), and the
trainer sets the unsolved group aside and waits for it (``trainer_service.groups.GroupBuffer``). The
two must agree exactly: if the trainer set a group aside that the scheduler did not re-sample, the
run would wait for a group that never comes. So both call these functions rather than restating
them (the registry reads its rows from SQLite, the trainer from the scored trajectories).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SampleOutcome:
    """What the rule needs of one scored sample."""

    reward: float
    """``Reward.total`` (the scalar the advantages are computed from)."""
    passed: bool
    """``Reward.passed``."""
    infra_error: bool
    """``Reward.infra_error``: the verifier could not score it (sandbox down, judge unreachable)."""


def is_unsolved(samples: Iterable[SampleOutcome]) -> bool:
    """True when no sample passed, none was an infrastructure error, and all rewards are equal (so
    every group-normalised advantage is 0 and the group teaches nothing). An empty group is unsolved.
    """
    rewards: set[float] = set()
    for s in samples:
        if s.passed or s.infra_error:
            return False
        rewards.add(s.reward)
    return len(rewards) <= 1


def resample_wanted(group_size: int, resample_unsolved: int) -> bool:
    """True when an unsolved group of ``group_size`` samples gets a re-sample of
    ``resample_unsolved`` samples: re-sampling is on and the re-sample is larger (so a re-sample,
    which has ``resample_unsolved`` samples itself, is never re-sampled again)."""
    return resample_unsolved > group_size
