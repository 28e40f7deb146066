"""Per-domain metrics of one optimizer step: one ``Metrics(source="trainer", domain=d)`` record per domain
trained in the step, sent on flywheel.metrics after the step's run-wide record
(:class:`trainer_service.publisher.Publisher`).

Pure arithmetic over the step's groups (no torch, no Kafka). The definitions match the run-wide
``train/*`` values of :meth:`trainer_service.trainer.PolicyTrainer.train_step`, restricted to one domain's rows:
a pass is a total reward of at least 1.0, a truncated sample one that ended with ``finish_reason`` ``length``,
and staleness is counted against the version the step trained from (``version - 1``). Rows are every sample
of the trained groups, before the truncation policy (``truncation: mask`` still counts its masked rows).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from trainer_service.groups import Group


def domain_metrics(groups: Iterable[Group], version: int) -> dict[str, dict[str, float]]:
    """``{domain: values}`` of the groups one step trained, which produced policy ``version``.

    Values (each a float): ``train/groups``, ``train/samples``, ``train/reward_mean`` (mean total reward),
    ``train/pass_rate`` (fraction with total ≥ 1), ``train/completion_tokens_mean`` (tokens per completion,
    tool output included), ``train/truncated_frac`` (fraction cut at the token budget),
    ``train/zero_variance_groups`` (groups whose rewards are all equal: no gradient), ``train/staleness_mean``
    and ``train/staleness_max`` (policy versions between the behaviour policy and the trained one).
    Domains in key order; a group with no sample is skipped.
    """
    rows: dict[str, list] = defaultdict(list)
    n_groups: dict[str, int] = defaultdict(int)
    zero_var: dict[str, int] = defaultdict(int)
    for g in groups:
        if not g.samples:
            continue
        d = g.domain
        n_groups[d] += 1
        zero_var[d] += int(g.zero_variance)
        rows[d].extend(g.rows())
    out: dict[str, dict[str, float]] = {}
    for d in sorted(rows):
        rs = rows[d]
        n = len(rs)
        rewards = [r.reward.total for r in rs]
        stale = [version - 1 - r.trajectory.behaviour_version for r in rs]
        out[d] = {
            "train/groups": float(n_groups[d]),
            "train/samples": float(n),
            "train/reward_mean": sum(rewards) / n,
            "train/pass_rate": sum(x >= 1.0 for x in rewards) / n,
            "train/completion_tokens_mean": sum(len(r.trajectory.completion_ids) for r in rs) / n,
            "train/truncated_frac": sum(r.trajectory.finish_reason == "length" for r in rs) / n,
            "train/zero_variance_groups": float(zero_var[d]),
            "train/staleness_mean": sum(stale) / n,
            "train/staleness_max": float(max(stale)),
        }
    return out
