"""The registry's ``rewards`` and ``eval_rounds`` tables: each RewardEvent counted once, and eval round results.

The :class:`RewardTables` mixin gives :class:`scheduler_service.registry.Registry` its reward and eval-round
methods. Recording a reward also moves its group (``received``, ``complete``), its task's pass rate and its
domain's spend, curriculum and task lifecycle, and may write a larger re-sample of an unsolved group, all in
the transaction that stores the reward (so a redelivered event changes nothing).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Sequence

from scheduler_service.group_store import IssuedGroup
from shared.groups import SampleOutcome, is_unsolved, resample_wanted
from shared.schemas import RewardEvent

REWARD_SCHEMA = """
CREATE TABLE IF NOT EXISTS rewards (
    trajectory_id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    counted INTEGER NOT NULL,
    passed INTEGER NOT NULL,
    reward REAL NOT NULL,
    infra_error INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS rewards_group ON rewards (group_id, sample_index);
CREATE TABLE IF NOT EXISTS eval_rounds (
    id INTEGER PRIMARY KEY,
    min_policy_version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    n_items INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class RewardOutcome:
    """What recording one RewardEvent did.

    ``new``: the trajectory id was not seen before. ``counted``: it filled a sample index of a
    known group for the first time. ``scored``: counted and not an infrastructure error (it
    changed the task's samples/passes). ``completed``: it completed its group. ``resample``: the
    group it completed was unsolved and a larger group of the same task was written for it
    (``pending``: the sampler's next pass sends it), see :meth:`Registry.record_reward`.
    """

    new: bool
    counted: bool
    scored: bool
    completed: bool
    resample: IssuedGroup | None = None
    notes: tuple[str, ...] = ()
    """What it changed beyond the group, for the log: a level move, a retired or flagged task."""
    selected: bool = False
    """The event's group was chosen for what it scored before (a re-sample of an unsolved group): its samples
    are not a fair sample of the domain's pass rate (the drift monitor leaves them out of its windows)."""
    level: int | None = None
    """The curriculum level of the event's task (a scored training sample; None otherwise): the level the sample
    was issued at, which after a level move differs from the domain's."""


class RewardTables:
    """Reward and eval-round methods of the registry (a mixin: needs ``_tx``, ``_one``, ``_all``, ``_new_group``
    of :class:`scheduler_service.group_store.GroupTables` and the domain methods of
    :class:`scheduler_service.domains.DomainTables`)."""

    def record_reward(self, ev: RewardEvent, resample_n: int = 0) -> RewardOutcome:
        """Count one RewardEvent once (by trajectory id, then by group id + sample index).

        Events of unknown groups (another scheduler's, or a task id that does not match) are
        ignored. Infrastructure errors fill their sample index but change no samples/passes.

        With ``resample_n`` > 0, an event that completes an *unsolved* training group writes, in
        the same transaction, one more ``pending`` group of the same task with ``resample_n``
        samples, returned as ``outcome.resample``; :meth:`take_pending` hands it to the sampler
        like an eval group, so it is sent even when the process stops right after this commit.
        Unsolved (:func:`shared.groups.is_unsolved`): no sample passed, none was an infrastructure
        error, all rewards are equal (so every advantage is 0); and re-sampled only when the group has
        fewer than ``resample_n`` samples (:func:`shared.groups.resample_wanted`) and is not itself a
        re-sample. The trainer sets such groups aside by calling the same functions
        (``trainer_service.groups.Group.unsolved``) and counts on the re-sample to take their place,
        so it is written even in a paused domain. One write per group, so a redelivered
        event never re-samples twice. The re-sample counts as one of the task's groups in the
        fewest-groups-first rotation.

        Per domain, in the same transaction: every counted sample's cost goes to its domain's spend; a
        scored training sample of the domain's current level feeds its curriculum window (and may move the
        level); a completed group moves its task's lifecycle (retired, flagged). ``outcome.notes`` says
        what changed.
        """
        return self.record_rewards([ev], resample_n)[0]

    def record_rewards(self, events: Sequence[RewardEvent], resample_n: int = 0) -> list[RewardOutcome]:
        """:meth:`record_reward` for each of ``events``, in order, in one transaction: one commit and one fsync
        for a polled batch (a transaction per reward capped the scheduler at about 1,100 rewards a second on this
        machine, each commit waiting on its fsync). The outcomes are those of recording the events one after the
        other (a later event sees what an earlier one wrote, curriculum windows included); an error rolls the
        whole batch back and is raised (the consumer re-reads the batch and dedupes by trajectory id)."""
        with self._tx() as db:
            outcomes = [self._record_reward(db, ev, resample_n) for ev in events]
        self._apply_windows()
        return outcomes

    def _record_reward(self, db: sqlite3.Connection, ev: RewardEvent, resample_n: int) -> RewardOutcome:
        nothing = RewardOutcome(False, False, False, False)
        g = db.execute('SELECT * FROM "groups" WHERE group_id = ?', (ev.group_id,)).fetchone()
        if g is None or g["task_id"] != ev.task_id:
            return nothing
        dup_index = db.execute(
            "SELECT 1 FROM rewards WHERE group_id = ? AND sample_index = ? AND counted = 1",
            (ev.group_id, ev.sample_index),
        ).fetchone()
        counted = dup_index is None and 0 <= ev.sample_index < g["n"]
        cur = db.execute(
            "INSERT OR IGNORE INTO rewards (trajectory_id, group_id, sample_index, counted, passed, reward,"
            " infra_error, policy_version, received_at, completion_tokens, completion_hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (ev.trajectory_id, ev.group_id, ev.sample_index, int(counted), int(ev.passed), ev.reward,
             int(ev.infra_error), ev.policy_version, time.time(), ev.completion_tokens, ev.completion_hash),
        )
        if cur.rowcount == 0:
            return nothing
        if not counted:
            return RewardOutcome(True, False, False, False)
        received = g["received"] + 1
        completed = received >= g["n"] and g["state"] != "complete"
        db.execute(
            'UPDATE "groups" SET received = ?, state = CASE WHEN ? THEN \'complete\' ELSE state END'
            " WHERE group_id = ?",
            (received, completed, ev.group_id),
        )
        scored = not ev.infra_error
        notes = []
        level = None
        self._account(db, ev)
        if scored:
            db.execute("UPDATE tasks SET samples = samples + 1, passes = passes + ? WHERE task_id = ?",
                       (int(ev.passed), ev.task_id))
            if g["purpose"] == "train":
                t = db.execute("SELECT domain, level FROM tasks WHERE task_id = ?", (ev.task_id,)).fetchone()
                level = t["level"]
                notes.append(self._curriculum(db, t["domain"], t["level"], ev.passed))
        if completed:
            notes.append(self._lifecycle(db, g, time.time()))
        resample = None
        if (completed and resample_wanted(g["n"], resample_n) and g["purpose"] == "train" and g["resample_of"] is None
                and g["dropped"] is None):  # a dropped group's slot was already given to a new group
            resample = self._resample_unsolved(db, g, self._resample_size(g["domain"], resample_n))
        return RewardOutcome(True, True, scored, completed, resample, tuple(n for n in notes if n),
                             g["resample_of"] is not None, level)

    def _resample_size(self, domain: str | None, resample_n: int) -> int:
        """Samples of a re-sample: ``budget.resample_unsolved``, or the domain's adaptive ``max`` when larger
        (an unsolved task is the adaptive rule's case p = 0)."""
        d = self._domains.get(domain) if domain else None
        a = d.config.adaptive_samples if d else None
        return max(resample_n, a.max) if a else resample_n

    def _resample_unsolved(self, db: sqlite3.Connection, g: sqlite3.Row, n: int) -> IssuedGroup | None:
        rows = db.execute("SELECT reward, passed, infra_error FROM rewards WHERE group_id = ? AND counted = 1",
                          (g["group_id"],))
        if not is_unsolved(SampleOutcome(r["reward"], bool(r["passed"]), bool(r["infra_error"])) for r in rows):
            return None
        return self._new_group(db, g["task_id"], "train", "pending", None, time.time(), None, n=n,
                               resample_of=g["group_id"])

    # ------------------------------------------------------------ eval rounds

    def create_eval_round(self, min_policy_version: int) -> int | None:
        """Create an eval round with one ``pending`` group (n = 1) per eval task, in one transaction.

        Round ids count from 0. Returns the round id, or ``None`` when no eval task is registered.
        """
        now = time.time()
        with self._tx() as db:
            ids = [r["task_id"] for r in db.execute("SELECT task_id FROM tasks WHERE split = 'eval' ORDER BY task_id")]
            if not ids:
                return None
            rid = db.execute("SELECT COALESCE(MAX(id), -1) + 1 AS r FROM eval_rounds").fetchone()["r"]
            db.execute("INSERT INTO eval_rounds (id, min_policy_version, created_at, n_items) VALUES (?, ?, ?, ?)",
                       (rid, min_policy_version, now, len(ids)))
            for tid in ids:
                self._new_group(db, tid, "eval", "pending", rid, now, None)
            return rid

    def eval_round(self, round_id: int) -> dict[str, Any] | None:
        """Summary of one eval round (``None`` when unknown).

        ``completed``: items with a (non infra-error) score; ``accuracy``: correct / completed
        (``None`` before any); ``done``: every group complete or abandoned.
        """
        r = self._one("SELECT * FROM eval_rounds WHERE id = ?", round_id)
        if r is None:
            return None
        g = self._one(
            'SELECT COUNT(*) AS total, COALESCE(SUM(state IN (\'complete\', \'abandoned\')), 0) AS finished,'
            ' COALESCE(SUM(state = \'abandoned\'), 0) AS abandoned FROM "groups" WHERE eval_round = ?',
            round_id,
        )
        s = self._one(
            "SELECT COUNT(*) AS completed, COALESCE(SUM(r.passed), 0) AS correct FROM rewards r"
            ' JOIN "groups" g ON g.group_id = r.group_id WHERE g.eval_round = ? AND r.counted = 1'
            " AND r.infra_error = 0",
            round_id,
        )
        versions = self._all(
            'SELECT DISTINCT r.policy_version AS v FROM rewards r JOIN "groups" g ON g.group_id = r.group_id'
            " WHERE g.eval_round = ? AND r.counted = 1 ORDER BY v",
            round_id,
        )
        return {
            "eval_round": r["id"],
            "min_policy_version": r["min_policy_version"],
            "n": r["n_items"],
            "completed": s["completed"],
            "correct": s["correct"],
            "accuracy": s["correct"] / s["completed"] if s["completed"] else None,
            "abandoned": g["abandoned"],
            "policy_versions": [v["v"] for v in versions],
            "done": g["finished"] == g["total"],
            "created_at": r["created_at"],
        }

    def eval_accuracy_by_domain(self, round_id: int) -> dict[str, tuple[int, int]]:
        """``{domain: (correct, completed)}`` of one eval round (scored items, infra errors left out)."""
        rows = self._all(
            'SELECT g.domain AS d, COUNT(*) AS completed, COALESCE(SUM(r.passed), 0) AS correct FROM rewards r'
            ' JOIN "groups" g ON g.group_id = r.group_id WHERE g.eval_round = ? AND r.counted = 1'
            " AND r.infra_error = 0 GROUP BY g.domain", round_id)
        return {r["d"]: (int(r["correct"]), int(r["completed"])) for r in rows if r["d"] is not None}

    def eval_rounds(self) -> list[dict[str, Any]]:
        """Summaries of every eval round, oldest first."""
        return [self.eval_round(r["id"]) for r in self._all("SELECT id FROM eval_rounds ORDER BY id")]

    def reward_rows_after(self, rowid: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` counted reward rows stored after row ``rowid``, in storage order, each with its
        group's ``domain``, ``purpose`` and size ``n`` (the dashboard reads the table incrementally:
        ``scheduler_service.dashboard_data``). Keys: ``rowid``, ``group_id``, ``domain``, ``purpose``, ``n``,
        ``passed``, ``reward``, ``infra_error``, ``policy_version`` (behaviour), ``received_at`` (Unix s),
        ``completion_tokens`` and ``completion_hash`` (``None`` in rows written before they were stored)."""
        return [dict(r) for r in self._all(
            "SELECT r.rowid AS rowid, r.group_id, g.domain, g.purpose, g.n, r.passed, r.reward, r.infra_error,"
            " r.policy_version, r.received_at, r.completion_tokens, r.completion_hash FROM rewards r"
            ' JOIN "groups" g ON g.group_id = r.group_id WHERE r.rowid > ? AND r.counted = 1 ORDER BY r.rowid'
            " LIMIT ?", rowid, limit)]
