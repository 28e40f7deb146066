"""Assembling complete groups from flywheel.scored, with staleness control and commit offsets.

Pure bookkeeping, no Kafka or torch: the service feeds records in and asks which groups are ready,
which groups were dropped since it last asked (:meth:`GroupBuffer.take_drops`: each is announced on
flywheel.group_drops so the scheduler gives its slot back) and which offset per partition is safe to
commit (the oldest record not yet trained or dropped, DESIGN.md "Delivery semantics"). Besides staleness,
the buffer drops the ready groups of domains flywheel.control blocks (:meth:`GroupBuffer.drop_blocked`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

from shared.groups import SampleOutcome, is_unsolved, resample_wanted
from shared.schemas import ScoredTrajectory

Partition = tuple[str, int]  # (topic, partition)

DROP_REASONS = {"dropped_stale": "stale", "dropped_failed": "failed", "superseded_unsolved": "superseded_unsolved",
                "dropped_unsolved": "unsolved", "dropped_canary": "canary",
                "dropped_circuit_open": "circuit_open", "dropped_domain_paused": "domain_paused"}
"""Counter name of each way a group leaves the buffer untrained -> ``GroupDropped.reason``."""

BLOCK_COUNTERS = {"circuit_open": "dropped_circuit_open", "domain_paused": "dropped_domain_paused"}
"""Why a domain is blocked (:meth:`GroupBuffer.drop_blocked`) -> the counter of the groups dropped for it."""


@dataclass(frozen=True)
class Drop:
    """A group the trainer will never train: what :class:`shared.schemas.GroupDropped` reports."""

    group_id: str
    reason: str
    behaviour_version: int | None
    samples: int


@dataclass
class Group:
    """The samples of one group seen so far, keyed by sample index."""

    group_id: str
    size: int
    samples: dict[int, ScoredTrajectory] = field(default_factory=dict)
    offsets: list[tuple[Partition, int]] = field(default_factory=list)
    _oldest: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)
    """``(samples seen, their oldest behaviour version)`` when :attr:`behaviour_version` last computed it."""
    canary_ok: bool | None = field(default=None, init=False, compare=False)
    """The canary check's verdict once made (``trainer_service/canary.py``; ``None``: not checked yet)."""

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.size

    def rows(self) -> list[ScoredTrajectory]:
        return [self.samples[i] for i in sorted(self.samples)]

    @property
    def zero_variance(self) -> bool:
        """All rewards equal: every advantage is exactly 0 and the group adds nothing to the gradient."""
        return len({s.reward.total for s in self.samples.values()}) <= 1

    @property
    def unsolved(self) -> bool:
        """:func:`shared.groups.is_unsolved` of its samples: the scheduler's test for re-sampling a group
        (``Registry.record_reward`` with ``budget.resample_unsolved``)."""
        return is_unsolved(SampleOutcome(s.reward.total, s.reward.passed, s.reward.infra_error)
                           for s in self.samples.values())

    @property
    def domain(self) -> str:
        """The task domain of its samples (a group is one task, so they share it).

        Raises:
            StopIteration: the group has no sample yet (a ready group always has one).
        """
        return next(iter(self.samples.values())).trajectory.domain

    @property
    def behaviour_version(self) -> int:
        """Oldest policy version that produced any token of the group (kept until a sample is added: the
        trainer asks for every ready group on every pass).

        Raises:
            ValueError: the group has no sample yet.
        """
        if self._oldest is None or self._oldest[0] != len(self.samples):
            self._oldest = (len(self.samples), min(s.trajectory.behaviour_version for s in self.samples.values()))
        return self._oldest[1]


class GroupBuffer:
    """Holds partial and ready groups between optimizer steps.

    Args:
        max_staleness: η; a complete group whose oldest token came from version v_b is dropped
            (and counted) once the trainer's version v has v − v_b > η.
        done_groups: group ids already trained or dropped (restored from a checkpoint); their
            records are skipped, so a redelivery never trains a sample twice.
        resample_unsolved: ``budget.resample_unsolved``. When > 0, a complete group smaller than
            this that is :attr:`Group.unsolved` is set aside (counted ``superseded_unsolved``), never
            trained: the scheduler has sent a larger group of the same task in its place, outside
            its issue budget, so the trainer still gets ``batch_groups`` groups for every step. An
            unsolved group of this size or larger (the re-sample) is dropped (``dropped_unsolved``,
            announced ``unsolved``; its slot comes back and the scheduler issues another group): its
            advantages are all 0, and the rows of a step go to groups that teach.
    """

    def __init__(self, max_staleness: int, done_groups: set[str] | None = None, resample_unsolved: int = 0) -> None:
        self.max_staleness = max_staleness
        self.resample_unsolved = resample_unsolved
        self.done_groups: set[str] = set(done_groups or ())
        self.partial: dict[str, Group] = {}
        self.ready: list[Group] = []
        self.in_flight: set[str] = set()  # taken for a step, not yet durable
        self.counters: Counter[str] = Counter()
        self.smallest_group: int | None = None
        """The fewest samples of any training group received so far (a step's row bound is set from it)."""
        self._pending: dict[Partition, dict[int, str]] = {}  # offset -> group_id, per partition
        self._next: dict[Partition, int] = {}  # highest offset seen + 1
        self._drops: list[Drop] = []  # dropped since the last take_drops()

    # ------------------------------------------------------------------ intake
    def add(self, scored: ScoredTrajectory | None, tp: Partition, offset: int) -> None:
        """Take one record (``None`` for one that needs no training: malformed, eval...)."""
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        if scored is None or scored.trajectory.purpose != "train":
            return
        tr = scored.trajectory
        gid = tr.group_id
        if gid in self.done_groups or gid in self.in_flight:
            self.counters["duplicates_skipped"] += 1
            return
        group = self.partial.get(gid)
        if group is None:
            if any(g.group_id == gid for g in self.ready):
                self.counters["duplicates_skipped"] += 1
                return
            group = self.partial[gid] = Group(gid, tr.group_size)
            self.smallest_group = min(self.smallest_group or tr.group_size, tr.group_size)
        if tr.sample_index in group.samples:
            self.counters["duplicates_skipped"] += 1
            return
        group.samples[tr.sample_index] = scored
        group.offsets.append((tp, offset))
        self._pending.setdefault(tp, {})[offset] = gid
        if scored.reward.infra_error or tr.finish_reason in ("error", "abort"):
            # a failed sample never trains as a zero reward: drop the group, the scheduler re-issues it
            self._finish(self.partial.pop(gid), "dropped_failed")
            return
        if group.complete:
            group = self.partial.pop(gid)
            if self.resample_unsolved and group.unsolved:
                # a smaller group is superseded by its re-sample, which trains in its place; the re-sample (or a
                # group as large) teaches nothing when unsolved too: all advantages 0, only the KL term would train
                self._finish(group, "superseded_unsolved" if resample_wanted(group.size, self.resample_unsolved)
                             else "dropped_unsolved")
            else:
                self.ready.append(group)

    # ------------------------------------------------------------------ staleness and batching
    def drop_stale(self, version: int) -> int:
        """Drop ready groups with ``version − v_behaviour > η``; returns how many were dropped."""
        keep, dropped = [], 0
        for g in self.ready:
            if version - g.behaviour_version > self.max_staleness:
                self._finish(g, "dropped_stale")
                dropped += 1
            else:
                keep.append(g)
        self.ready = keep
        return dropped

    def drop_blocked(self, blocked: Mapping[str, str], groups: Container[str] = ()) -> int:
        """Drop the ready groups whose :attr:`Group.domain` is a key of ``blocked`` (domain -> reason,
        ``circuit_open`` or ``domain_paused``: :attr:`trainer_service.control.ControlState.blocked`); each
        is announced by :meth:`take_drops` with that reason and counted ``dropped_<reason>``.

        A ready group whose id is in ``groups`` (a closed breaker's probe) is dropped ``circuit_open``
        whatever its domain. Partial groups are left alone: call this every pass and a group of a blocked domain is dropped
        on the pass it completes. Groups already taken for a step (in flight) are not touched.

        Returns:
            How many groups were dropped.

        Raises:
            ValueError: a reason is neither ``circuit_open`` nor ``domain_paused`` (nothing is dropped).
        """
        if not blocked and not groups:
            return 0
        bad = {r for r in blocked.values() if r not in BLOCK_COUNTERS}
        if bad:
            raise ValueError(f"unknown block reasons {sorted(bad)}: expected one of {sorted(BLOCK_COUNTERS)}")
        keep, dropped = [], 0
        for g in self.ready:
            reason = "circuit_open" if g.group_id in groups else blocked.get(g.domain)
            if reason is None:
                keep.append(g)
            else:
                self._finish(g, BLOCK_COUNTERS[reason])
                dropped += 1
        self.ready = keep
        return dropped

    def drop_unless(self, keep: Callable[[Group], bool], counter: str) -> int:
        """Drop every ready group for which ``keep(group)`` is false, counted (and announced) as ``counter``, a key
        of :data:`DROP_REASONS`; returns how many were dropped."""
        kept, dropped = [], 0
        for g in self.ready:
            if keep(g):
                kept.append(g)
            else:
                self._finish(g, counter)
                dropped += 1
        self.ready = kept
        return dropped

    def take(self, n: int, prefer_informative: bool = False, max_samples: int | None = None) -> list[Group]:
        """Remove and return ``n`` ready groups (fewer if not enough): the oldest, or with
        ``prefer_informative`` the oldest groups whose rewards differ, then the oldest others.

        With ``max_samples``, a group that would take the step past that many samples (rows) is passed over
        and stays ready for a later step (counted ``deferred_groups``); the first group in that order is
        always taken, so a step never waits on a group larger than the bound.

        They stay held (records skipped, offsets not released) until :meth:`mark_trained`.
        """
        order = sorted(range(len(self.ready)), key=lambda i: (prefer_informative and self.ready[i].zero_variance, i))
        if max_samples is not None:
            kept, rows = [], 0
            for i in order:
                if len(kept) == n:
                    break
                size = len(self.ready[i].samples)
                if kept and rows + size > max_samples:
                    self.counters["deferred_groups"] += 1
                    continue
                kept.append(i)
                rows += size
            order = kept
        picked = set(order[:n])
        out = [self.ready[i] for i in sorted(picked)]
        self.ready = [g for i, g in enumerate(self.ready) if i not in picked]
        self.in_flight.update(g.group_id for g in out)
        return out

    def mark_trained(self, groups: list[Group]) -> None:
        """Record ``groups`` as trained: their offsets are released for committing."""
        for g in groups:
            self.in_flight.discard(g.group_id)
            self._finish(g, "trained_groups")

    def take_drops(self) -> list[Drop]:
        """The groups dropped (stale, failed, superseded, blocked domain) since the last call, oldest first;
        clears them.

        The caller must have them acknowledged on flywheel.group_drops before it commits
        :meth:`commit_offsets` (which already releases their records), or a crash loses the notice.
        """
        out, self._drops = self._drops, []
        return out

    def return_drops(self, drops: list[Drop]) -> None:
        """Put back drops that could not be announced (they come first in the next :meth:`take_drops`)."""
        self._drops[:0] = drops

    @property
    def has_drops(self) -> bool:
        """Whether :meth:`take_drops` has something to return."""
        return bool(self._drops)

    def _finish(self, g: Group, counter: str) -> None:
        self.counters[counter] += 1
        if counter in DROP_REASONS:
            bv = g.behaviour_version if g.samples else None
            self._drops.append(Drop(g.group_id, DROP_REASONS[counter], bv, len(g.samples)))
        self.done_groups.add(g.group_id)
        for tp, off in g.offsets:
            self._pending.get(tp, {}).pop(off, None)

    def describe(self) -> str:
        """One log line of what is held: partial groups (with their sample counts), ready, in-flight,
        counters and the read position per partition. For diagnosing a trainer that waits."""
        partial = ", ".join(f"{g.group_id}={len(g.samples)}/{g.size}" for g in self.partial.values())
        return (f"partial [{partial}] ready {[g.group_id for g in self.ready]} in_flight {sorted(self.in_flight)} "
                f"done {len(self.done_groups)} counters {dict(self.counters)} next {self._next} "
                f"commit {self.commit_offsets()}")

    # ------------------------------------------------------------------ commits
    def commit_offsets(self) -> dict[Partition, int]:
        """Per partition, the offset to commit: the oldest record still held, else the next unread."""
        out = {}
        for tp, nxt in self._next.items():
            pend = self._pending.get(tp)
            out[tp] = min(pend) if pend else nxt
        return out
