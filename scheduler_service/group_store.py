"""The registry's ``groups`` table: the rollout groups issued for tasks, from written to complete or abandoned.

The :class:`GroupTables` mixin gives :class:`scheduler_service.registry.Registry` its group methods; every
call is one short transaction, and a group's row is written before its request is sent.

Group states: ``pending`` (written, not yet sent: eval rounds), ``issued`` (sent, rewards
outstanding), ``complete`` (a reward for every sample index) and ``abandoned`` (deadline passed
``max_attempts`` times, or a request that can never be produced: ``abandon_reason`` says which).
A group whose send failed goes back to ``pending`` with a ``retry_at`` (:meth:`GroupTables.release_groups`);
after a broker restart every in-flight group is re-issued at once (:meth:`GroupTables.reissue_in_flight`)
without using up one of its ``max_attempts`` (``free_attempts``).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson

from shared.schemas import Task

GROUP_SCHEMA = """
CREATE TABLE IF NOT EXISTS "groups" (
    group_id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL REFERENCES tasks (task_id),
    purpose TEXT NOT NULL CHECK (purpose IN ('train', 'eval')),
    attempt INTEGER NOT NULL,
    n INTEGER NOT NULL,
    eval_round INTEGER,
    issued_at REAL,
    deadline REAL,
    state TEXT NOT NULL CHECK (state IN ('pending', 'issued', 'complete', 'abandoned')),
    received INTEGER NOT NULL DEFAULT 0,
    resample_of TEXT,
    dropped TEXT
);
CREATE INDEX IF NOT EXISTS groups_state ON "groups" (state, deadline);
CREATE INDEX IF NOT EXISTS groups_round ON "groups" (eval_round);
"""


@dataclass(frozen=True)
class IssuedGroup:
    """A group to send as a RolloutRequest (its row is already written).

    ``payload`` is the task's stored JSON (:func:`scheduler_service.task_store.canonical_payload`); :attr:`task`
    validates it on first use, so issuing never re-validates a task (the sampler splices the payload into the
    request).
    """

    group_id: str
    payload: str
    purpose: str
    attempt: int
    n: int
    eval_round: int | None
    min_policy_version: int
    task_id: str
    domain: str
    pool: str = "default"
    """Rollout pool of the request: the task's ``pool``, else its domain's."""
    max_tokens: int | None = None
    """The domain's ``max_new_tokens`` (``None``: the scheduler's)."""
    temperature: float | None = None
    """The domain's training temperature (``None``: the scheduler's)."""

    @cached_property
    def task(self) -> Task:
        """The task record (validated from :attr:`payload` on first use)."""
        return Task.model_validate_json(self.payload)


class GroupTables:
    """Group methods of the registry (a mixin: needs ``_tx``, ``_one``, ``_all``, ``_rng``, ``_ahead``,
    ``_samples`` of :class:`scheduler_service.task_store.TaskTables` and the domain rows)."""

    def _new_group(self, db: sqlite3.Connection, task_id: str, purpose: str, state: str,
                   eval_round: int | None, now: float, deadline: float | None, n: int | None = None,
                   resample_of: str | None = None) -> IssuedGroup:
        row = db.execute("SELECT payload, groups_issued, domain FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        group_id = f"{task_id}:{row['groups_issued']}"
        if n is None:
            n = self._samples(orjson.loads(row["payload"])) if purpose == "train" else 1
        db.execute(
            'INSERT INTO "groups" (group_id, task_id, purpose, attempt, n, eval_round, issued_at, deadline, state,'
            " resample_of, domain) VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?)",
            (group_id, task_id, purpose, n, eval_round, now if state == "issued" else None, deadline, state,
             resample_of, row["domain"]),
        )
        db.execute(  # a new random rank among the tasks with as many groups: a new order every epoch
            "UPDATE tasks SET groups_issued = groups_issued + 1, rnd = ?,"
            " state = CASE WHEN split = 'train' THEN 'active' ELSE state END WHERE task_id = ?",
            (self._rng.random(), task_id),
        )
        for block in self._ahead.get(row["domain"], {}).values():  # it moves to the back of its domain's order
            if block and block[0][0] == task_id:
                del block[0]
            elif any(b[0] == task_id for b in block):
                block[:] = [b for b in block if b[0] != task_id]
        return self._group(group_id, row["payload"], purpose, 1, n, eval_round, 0)

    def _group(self, gid: str, payload: str, purpose: str, attempt: int, n: int, eval_round: int | None,
               mpv: int) -> IssuedGroup:
        task = orjson.loads(payload)
        d = self._domains.get(task["domain"])
        pool = task.get("pool") or (d.config.pool if d else "default")
        return IssuedGroup(gid, payload, purpose, attempt, n, eval_round, mpv, task["task_id"], task["domain"], pool,
                           d.config.max_tokens if d else None, d.config.temperature if d else None)

    def issue_train_groups(self, task_ids: list[str] | list[tuple[str, int]], deadline_s: float) -> list[IssuedGroup]:
        """Write one new ``issued`` training group per task id (one transaction), before it is sent.

        Group ids are ``f"{task_id}:{seq}"`` with ``seq`` the task's count of groups so far. An entry
        ``(task_id, n)`` sets the group's samples (``None`` or a bare id: :meth:`_samples`).
        """
        now = time.time()
        out = []
        with self._tx() as db:
            for entry in task_ids:
                tid, n = entry if isinstance(entry, tuple) else (entry, None)
                out.append(self._new_group(db, tid, "train", "issued", None, now, now + deadline_s, n=n))
        return out

    def train_group_counts(self) -> tuple[int, int]:
        """``(issued, in_flight)`` training groups. ``issued`` counts the slots of the issue budget in
        use: every group neither abandoned nor dropped by the trainer (:meth:`record_drop`), except
        re-samples of unsolved groups (extra groups, like oversampling; each holds its original's
        slot). ``in_flight`` counts every group still ``issued``, re-samples too, except those the trainer
        already dropped (their records will never train, so a replacement need not wait for them)."""
        row = self._one(
            "SELECT COALESCE(SUM(state != 'abandoned' AND resample_of IS NULL AND dropped IS NULL), 0) AS issued,"
            " COALESCE(SUM(state = 'issued' AND dropped IS NULL), 0) AS fl FROM \"groups\" WHERE purpose = 'train'"
        )
        return int(row["issued"]), int(row["fl"])

    def eval_backlog(self) -> tuple[float | None, int]:
        """``(created_at, in_flight)`` of evaluation groups: the creation time (Unix s) of the oldest eval round
        with a group still ``pending`` (``None``: none waits), and how many eval groups are ``issued``."""
        row = self._one(
            'SELECT (SELECT MIN(r.created_at) FROM "groups" g JOIN eval_rounds r ON r.id = g.eval_round'
            " WHERE g.state = 'pending' AND g.purpose = 'eval') AS oldest,"
            ' (SELECT COUNT(*) FROM "groups" WHERE state = \'issued\' AND purpose = \'eval\') AS fl')
        return row["oldest"], int(row["fl"])

    def group_state_counts(self) -> dict[str, int]:
        """Groups per state (all purposes), every state present."""
        out = {"pending": 0, "issued": 0, "complete": 0, "abandoned": 0}
        for row in self._all('SELECT state, COUNT(*) AS c FROM "groups" GROUP BY state'):
            out[row["state"]] = row["c"]
        return out

    def dropped_counts(self) -> dict[str, int]:
        """Training groups the trainer dropped, per reason (``resample_<reason>``: the original of a
        dropped re-sample, whose slot came back with it)."""
        rows = self._all('SELECT dropped, COUNT(*) AS c FROM "groups" WHERE dropped IS NOT NULL GROUP BY dropped')
        return {r["dropped"]: int(r["c"]) for r in rows}

    def record_drop(self, group_id: str, reason: str) -> str | None:
        """Record that the trainer will never train ``group_id`` (a ``GroupDropped``), in one transaction.

        The group's slot in the issue budget comes back (:meth:`train_group_counts`), except for a
        group ``superseded_unsolved`` by a re-sample that was written (the re-sample holds the slot).
        A dropped re-sample gives its original's slot back. A dropped group still in flight is
        never re-issued (:meth:`expire_groups`). Idempotent: a repeated notice, or one for a group
        that is unknown, not a training group or already dropped, changes nothing.

        Returns:
            The id of the group whose slot came back (``group_id`` or, for a re-sample, its
            original), or ``None`` when nothing changed.
        """
        with self._tx() as db:
            g = db.execute('SELECT * FROM "groups" WHERE group_id = ?', (group_id,)).fetchone()
            if g is None or g["purpose"] != "train" or g["dropped"] is not None:
                return None
            if reason == "superseded_unsolved" and db.execute(
                'SELECT 1 FROM "groups" WHERE resample_of = ?', (group_id,)
            ).fetchone():
                return None  # set aside for its re-sample, which trains in its place
            db.execute('UPDATE "groups" SET dropped = ? WHERE group_id = ?', (reason, group_id))
            if g["resample_of"] is None:
                return group_id
            cur = db.execute('UPDATE "groups" SET dropped = ? WHERE group_id = ? AND dropped IS NULL',
                             (f"resample_{reason}", g["resample_of"]))
            return g["resample_of"] if cur.rowcount else None

    def get_group(self, group_id: str) -> dict[str, Any] | None:
        """The row of one group (``None`` when unknown)."""
        row = self._one('SELECT * FROM "groups" WHERE group_id = ?', group_id)
        return dict(row) if row else None

    def _issued(self, db: sqlite3.Connection, row: sqlite3.Row) -> IssuedGroup:
        payload = db.execute("SELECT payload FROM tasks WHERE task_id = ?", (row["task_id"],)).fetchone()["payload"]
        mpv = 0
        if row["eval_round"] is not None:
            r = db.execute("SELECT min_policy_version FROM eval_rounds WHERE id = ?", (row["eval_round"],)).fetchone()
            mpv = r["min_policy_version"] if r else 0
        return self._group(row["group_id"], payload, row["purpose"], row["attempt"],
                           row["n"], row["eval_round"], mpv)

    def take_pending(self, deadline_s: float, limit: int = 1000, purpose: str | None = None) -> list[IssuedGroup]:
        """Mark up to ``limit`` pending groups ``issued`` (deadline now + ``deadline_s``) and return them, oldest
        first, only those of ``purpose`` (``train``: re-samples of unsolved groups; ``eval``) when given;
        groups released after a failed send wait until their ``retry_at``."""
        now = time.time()
        with self._tx() as db:
            rows = db.execute(
                'SELECT * FROM "groups" WHERE state = \'pending\' AND (retry_at IS NULL OR retry_at <= ?)'
                " AND (? IS NULL OR purpose = ?) ORDER BY rowid LIMIT ?", (now, purpose, purpose, limit)
            ).fetchall()
            for r in rows:
                db.execute('UPDATE "groups" SET state = \'issued\', issued_at = ?, deadline = ? WHERE group_id = ?',
                           (now, now + deadline_s, r["group_id"]))
            return [self._issued(db, r) for r in rows]

    def expire_groups(self, deadline_s: float, max_attempts: int) -> tuple[list[IssuedGroup], list[str]]:
        """Handle issued groups past their deadline: re-issue (attempt + 1) or abandon (also, silently,
        groups the trainer has dropped: their slot is already back).

        Returns:
            ``(reissued, abandoned_ids)``; re-issued rows already carry the new attempt and deadline.
        """
        now = time.time()
        reissued, abandoned = [], []
        with self._tx() as db:
            rows = db.execute(
                'SELECT * FROM "groups" WHERE state = \'issued\' AND deadline < ? ORDER BY deadline', (now,)
            ).fetchall()
            for r in rows:
                if r["dropped"] is not None:  # the trainer skips its records: nothing to wait for
                    db.execute('UPDATE "groups" SET state = \'abandoned\' WHERE group_id = ?', (r["group_id"],))
                    continue
                if r["attempt"] - (r["free_attempts"] or 0) >= max_attempts:  # broker restarts are free
                    db.execute('UPDATE "groups" SET state = \'abandoned\' WHERE group_id = ?', (r["group_id"],))
                    abandoned.append(r["group_id"])
                    continue
                db.execute(
                    'UPDATE "groups" SET attempt = attempt + 1, issued_at = ?, deadline = ? WHERE group_id = ?',
                    (now, now + deadline_s, r["group_id"]),
                )
                row = db.execute('SELECT * FROM "groups" WHERE group_id = ?', (r["group_id"],)).fetchone()
                reissued.append(self._issued(db, row))
        return reissued, abandoned

    def release_groups(self, group_ids: list[str], backoff_s: float = 1.0, max_backoff_s: float = 30.0
                       ) -> dict[str, float]:
        """Put issued groups whose request could not be sent back to ``pending``: :meth:`take_pending` hands
        them out again after ``min(max_backoff_s, backoff_s · 2^(failures − 1))`` seconds (without it a failed
        send left every row ``issued`` until its deadline, 3 × 600 s for an eval round).

        Returns:
            ``{group_id: seconds until its retry}`` for the groups released (rows no longer issued are left).
        """
        now, out = time.time(), {}
        with self._tx() as db:
            for gid in group_ids:
                row = db.execute('SELECT send_failures FROM "groups" WHERE group_id = ? AND state = \'issued\'',
                                 (gid,)).fetchone()
                if row is None:
                    continue
                failures = (row["send_failures"] or 0) + 1
                wait = min(max_backoff_s, backoff_s * 2 ** (failures - 1))
                db.execute('UPDATE "groups" SET state = \'pending\', send_failures = ?, retry_at = ?, issued_at = NULL,'
                           " deadline = NULL WHERE group_id = ?", (failures, now + wait, gid))
                out[gid] = wait
        return out

    def abandon_groups(self, reasons: dict[str, str]) -> list[str]:
        """Abandon groups whose request can never be produced (``{group_id: reason}``, e.g. larger than the
        broker's record limit), recording the reason; a training group gives its budget slot back. Returns the
        ids abandoned (complete or already abandoned rows are left as they are)."""
        done = []
        with self._tx() as db:
            for gid, reason in reasons.items():
                cur = db.execute('UPDATE "groups" SET state = \'abandoned\', abandon_reason = ?, retry_at = NULL'
                                 " WHERE group_id = ? AND state IN ('issued', 'pending')", (reason[:2000], gid))
                if cur.rowcount:
                    done.append(gid)
        return done

    def reissue_in_flight(self, before: float, deadline_s: float, recent_complete: int = 0) -> list[IssuedGroup]:
        """After a broker restart (memory storage: every request and result in flight is gone): re-issue every
        ``issued`` group sent before ``before`` (Unix s) at once, with a new deadline, and make ``pending``
        groups waiting for a retry due now.

        Each re-issued group gets attempt + 1 (its samples get new trajectory ids, the same path as a deadline
        re-issue; the trainer keys samples by group id and sample index, so nothing trains twice) but the
        attempt is free: it does not count towards ``max_attempts`` (:meth:`expire_groups`). Groups the trainer
        dropped are left to :meth:`expire_groups`. Groups already re-issued after ``before`` are left, so a
        second notice of the same restart does nothing.

        ``recent_complete``: also re-send, without changing their state, the last ``recent_complete`` training
        groups completed before ``before`` (by their last reward). The scheduler counts a group complete when its
        rewards arrive, but the trainer trains it from flywheel.scored, which the broker lost: such a group was
        never trained and, without a re-send, holds its budget slot for good (measured: the run stalled after
        two broker restarts with ``(η + 1) · B`` slots held this way). Issued minus trained is at most
        ``(η + 1) · B``, so that many cover every group that can be untrained; one the trainer already trained is
        skipped by it (its ``done_groups``), and its rewards are not counted twice here (sample indices).
        """
        now = time.time()
        out = []
        with self._tx() as db:
            rows = db.execute('SELECT group_id FROM "groups" WHERE state = \'issued\' AND dropped IS NULL'
                              " AND (issued_at IS NULL OR issued_at < ?) ORDER BY rowid", (before,)).fetchall()
            for r in rows:
                db.execute('UPDATE "groups" SET attempt = attempt + 1, free_attempts = free_attempts + 1, issued_at = ?,'
                           " deadline = ? WHERE group_id = ?", (now, now + deadline_s, r["group_id"]))
                row = db.execute('SELECT * FROM "groups" WHERE group_id = ?', (r["group_id"],)).fetchone()
                out.append(self._issued(db, row))
            db.execute('UPDATE "groups" SET retry_at = NULL WHERE state = \'pending\' AND retry_at IS NOT NULL')
            if recent_complete > 0:
                done = db.execute(
                    'SELECT g.group_id FROM "groups" g JOIN rewards r ON r.group_id = g.group_id WHERE g.state = '
                    "'complete' AND g.purpose = 'train' AND g.dropped IS NULL GROUP BY g.group_id"
                    " HAVING MAX(r.received_at) < ? ORDER BY MAX(r.received_at) DESC LIMIT ?",
                    (before, recent_complete)).fetchall()
                for r in done:
                    db.execute('UPDATE "groups" SET attempt = attempt + 1, free_attempts = free_attempts + 1'
                               " WHERE group_id = ?", (r["group_id"],))
                    row = db.execute('SELECT * FROM "groups" WHERE group_id = ?', (r["group_id"],)).fetchone()
                    out.append(self._issued(db, row))
        return out

    def resend_unanswered(self, before: float, deadline_s: float) -> list[IssuedGroup]:
        """After a restart of the scheduler itself: the groups ``issued`` before ``before`` (Unix s, the process
        start) with no reward yet, to send again with the same attempt (a new deadline, ``deadline_s`` from now).

        A group's row is written ``issued`` before its request is produced, so a kill -9 between the two leaves
        a group the broker never saw; it used to hold its budget slot until ``scheduler.group_deadline_s``
        (measured: the run stalled at its last step for 600 s). Which ones were sent is not known here, so every
        unanswered one is sent again; a duplicate request gives the same trajectory ids, whose rewards are
        counted once (:meth:`record_reward`) and whose samples the trainer trains once. The cost: at most the
        in-flight groups, ``(η + 1) · B``, generated twice per scheduler restart.
        """
        now = time.time()
        out = []
        with self._tx() as db:
            rows = db.execute(
                'SELECT group_id FROM "groups" g WHERE state = \'issued\' AND dropped IS NULL AND issued_at < ?'
                " AND NOT EXISTS (SELECT 1 FROM rewards r WHERE r.group_id = g.group_id) ORDER BY rowid",
                (before,)).fetchall()
            for r in rows:
                db.execute('UPDATE "groups" SET issued_at = ?, deadline = ? WHERE group_id = ?',
                           (now, now + deadline_s, r["group_id"]))
                row = db.execute('SELECT * FROM "groups" WHERE group_id = ?', (r["group_id"],)).fetchone()
                out.append(self._issued(db, row))
        return out

    def in_flight_count(self, before: float | None = None) -> int:
        """Groups ``issued`` and not dropped (requests the broker holds or a service works on), only those sent
        before ``before`` (Unix s) when given."""
        row = self._one('SELECT COUNT(*) AS c FROM "groups" WHERE state = \'issued\' AND dropped IS NULL'
                        " AND issued_at < ?", float("inf") if before is None else before)
        return int(row["c"])
