"""The one unsolved-group rule (shared/groups.py) that the scheduler and the trainer both call."""

from shared.groups import SampleOutcome, is_unsolved, resample_wanted


def _s(reward: float, passed: bool = False, infra: bool = False) -> SampleOutcome:
    return SampleOutcome(reward, passed, infra)


def test_a_group_is_unsolved_only_when_nothing_passed_nothing_failed_to_score_and_rewards_are_equal():
    assert is_unsolved([_s(0.0), _s(0.0)])
    assert is_unsolved([_s(0.2), _s(0.2)])  # equal partial credit, none passed: every advantage is 0
    assert not is_unsolved([_s(0.0), _s(1.0, passed=True)])
    assert not is_unsolved([_s(1.0, passed=True), _s(1.0, passed=True)])  # solved, not unsolved
    assert not is_unsolved([_s(0.0), _s(0.5)])  # rewards differ: the group teaches something
    assert not is_unsolved([_s(0.0), _s(0.0, infra=True)])  # a sample the verifier could not score


def test_a_resample_is_wanted_only_when_it_is_larger_than_the_group():
    assert resample_wanted(8, 24)
    assert not resample_wanted(24, 24)  # a re-sample is never re-sampled
    assert not resample_wanted(8, 0)  # off
