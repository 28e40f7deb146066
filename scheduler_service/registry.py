"""The scheduler's task registry: SQLite through the stdlib ``sqlite3`` module.

What must survive a broker loss lives here (DESIGN.md, "Delivery semantics"): tasks, their
pass rates, the groups issued for them, the reward events already counted and the policy version.
One connection in WAL mode with ``synchronous=FULL``, shared by the event loop and worker
threads under a lock; every call is one short transaction.

Group states: ``pending`` (written, not yet sent: eval rounds), ``issued`` (sent, rewards
outstanding), ``complete`` (a reward for every sample index) and ``abandoned`` (deadline passed
``max_attempts`` times, or a request that can never be produced: ``abandon_reason`` says which).
A group whose send failed goes back to ``pending`` with a ``retry_at`` (:meth:`Registry.release_groups`);
after a broker restart every in-flight group is re-issued at once (:meth:`Registry.reissue_in_flight`)
without using up one of its ``max_attempts`` (``free_attempts``).
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import orjson

from scheduler_service.config import DomainConfig
from scheduler_service.monitor_store import MONITOR_SCHEMA, MonitorTables
from scheduler_service.domains import DOMAIN_SCHEMA, TASK_COLUMNS, DomainTables, content_key, level_of
from shared.config import RunConfig
from shared.groups import SampleOutcome, is_unsolved, resample_wanted
from shared.schemas import RewardEvent, Task

_READ_AHEAD = 64
"""Training tasks read ahead per domain and level (:meth:`Registry.next_train_tasks`)."""

_PAUSED_KEY = "paused_domains"
"""Where registries written before domains had their own table kept the paused ones (moved on open)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY,
    domain TEXT NOT NULL,
    split TEXT NOT NULL CHECK (split IN ('train', 'eval')),
    difficulty REAL NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    samples INTEGER NOT NULL DEFAULT 0,
    passes INTEGER NOT NULL DEFAULT 0,
    groups_issued INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_split_issued ON tasks (split, groups_issued);
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
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
""" + DOMAIN_SCHEMA + MONITOR_SCHEMA

_INDEXES = """
CREATE INDEX IF NOT EXISTS tasks_pick ON tasks (domain, level, groups_issued, rnd) WHERE split = 'train' AND retired = 0;
CREATE INDEX IF NOT EXISTS tasks_content ON tasks (domain, content_key);
CREATE INDEX IF NOT EXISTS groups_domain ON "groups" (domain, state);
"""


class TaskConflictError(ValueError):
    """Some task ids of a batch are already registered (or repeated in the batch) with other content."""

    def __init__(self, task_ids: list[str]) -> None:
        super().__init__(f"task ids registered with different content: {', '.join(task_ids[:20])}")
        self.task_ids = task_ids


@dataclass(frozen=True)
class IssuedGroup:
    """A group to send as a RolloutRequest (its row is already written).

    ``payload`` is the task's stored JSON (:func:`canonical_payload`); :attr:`task` validates it on
    first use, so issuing never re-validates a task (the sampler splices the payload into the request).
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


@dataclass(frozen=True)
class Registration:
    """What :meth:`Registry.register` did with a batch: ``task_ids[i]`` is the id the i-th task is
    stored under (its own, or for a duplicate the task it duplicates); ``new``: the tasks stored now;
    ``duplicates``: ``(posted id, id of the stored task with the same content)``."""

    task_ids: list[str]
    new: list[Task]
    duplicates: list[tuple[str, str]]


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


def canonical_payload(task: Task) -> str:
    """The stored JSON of ``task`` (sorted keys, so equal content gives equal text)."""
    return orjson.dumps(task.model_dump(mode="json", by_alias=True), option=orjson.OPT_SORT_KEYS).decode()


def sqlite_path(database_url: str, run: RunConfig) -> Path:
    """File of a ``sqlite:///PATH`` URL; relative paths resolve under the run directory.

    Raises:
        ValueError: the URL is not ``sqlite:///...`` (other databases are not supported yet).
    """
    prefix = "sqlite:///"
    if not database_url.startswith(prefix) or len(database_url) == len(prefix):
        raise ValueError(f"unsupported database_url {database_url!r}: expected sqlite:///PATH")
    return run.path(database_url[len(prefix):])


def _add_columns(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Add the columns a registry written by an earlier version lacks."""
    have = {r["name"] for r in db.execute(f'PRAGMA table_info("{table}")')}
    for col, decl in columns.items():
        if col not in have:
            try:
                db.execute(f'ALTER TABLE "{table}" ADD COLUMN {col} {decl}')
            except sqlite3.OperationalError as e:  # another process added it first
                if "duplicate column" not in str(e):
                    raise


class Registry(DomainTables, MonitorTables):
    """Tasks, groups, counted rewards, eval rounds, domains and key/values in one SQLite file.

    Thread-safe (one connection under a lock). Times are Unix seconds.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        # columns a registry written by an earlier version lacks: re-samples, the trainer's drops, domains
        _add_columns(self._db, "groups", {"resample_of": "TEXT", "dropped": "TEXT", "domain": "TEXT",
                                          # failed sends and broker restarts
                                          "send_failures": "INTEGER NOT NULL DEFAULT 0", "retry_at": "REAL",
                                          "abandon_reason": "TEXT", "free_attempts": "INTEGER NOT NULL DEFAULT 0"})
        _add_columns(self._db, "tasks", TASK_COLUMNS)
        _add_columns(self._db, "rewards", {"completion_tokens": "INTEGER", "completion_hash": "TEXT"})  # dashboard
        self._db.executescript(_INDEXES)
        self._rng = random.Random(0)
        self._ahead: dict[str, dict[int, list[tuple[str, int, int]]]] = {}
        self._load_domains()
        self._migrate_paused()

    def _migrate_paused(self) -> None:
        """Move the paused domains of a registry from before the domains table into it."""
        old = self.kv_get(_PAUSED_KEY)
        if not old:
            return
        for name, v in old.items():
            self.pause_domain(name, v.get("reason", "misconfigured"), v.get("task_id"))
        with self._tx() as db:
            db.execute("DELETE FROM kv WHERE key = ?", (_PAUSED_KEY,))

    @classmethod
    def from_url(cls, database_url: str, run: RunConfig) -> "Registry":
        """Open (creating if needed) the registry named by ``database_url``; see :func:`sqlite_path`."""
        return cls(sqlite_path(database_url, run))

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                self._window_moves, self._moved = {}, set()  # nothing of it was stored
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, *args: Any) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ------------------------------------------------------------ tasks

    def register_tasks(self, tasks: list[Task]) -> list[str]:
        """:meth:`register` returning the posted ids (the duplicates' own ids included)."""
        self.register(tasks)
        return [t.task_id for t in tasks]

    def register(self, tasks: list[Task], level: int | None = None) -> Registration:
        """Store a batch of tasks in one transaction: all or nothing.

        A task id already stored with the same content is accepted again (idempotent). A task with a new
        id whose content (:func:`scheduler_service.domains.content_key`: domain, normalised prompt,
        verifier spec) is already stored in its domain, or earlier in the batch, is not stored: it is
        reported as a duplicate of that task (and ``GET /v1/tasks/{id}`` shows that one). Domains seen for
        the first time are created with the default config.

        Args:
            tasks: the batch.
            level: the level of every task (a generator's batch); ``None``: from each task's difficulty
                and its domain's levels (:func:`scheduler_service.domains.level_of`).

        Raises:
            TaskConflictError: an id is stored, or repeated in the batch, with different content
                (nothing of the batch is stored).
        """
        now = time.time()
        seen: dict[str, str] = {}
        keys: dict[tuple[str, str], str] = {}
        conflicts: list[str] = []
        ids, new, dups = [], [], []
        with self._tx() as db:
            self._ensure_domains(db, {t.domain for t in tasks})
            for t in tasks:
                payload = canonical_payload(t)
                if t.task_id in seen:
                    if seen[t.task_id] != payload:
                        conflicts.append(t.task_id)
                    ids.append(ids[list(seen).index(t.task_id)])
                    continue
                seen[t.task_id] = payload
                row = db.execute("SELECT payload FROM tasks WHERE task_id = ?", (t.task_id,)).fetchone()
                if row is not None:
                    if row["payload"] != payload:
                        conflicts.append(t.task_id)
                    ids.append(t.task_id)
                    continue
                key = content_key(t)
                kept = keys.get((t.domain, key)) or self._stored_with(db, t.domain, key)
                if kept is not None:
                    db.execute("INSERT OR IGNORE INTO duplicates (task_id, duplicate_of, domain, at) VALUES (?, ?, ?, ?)",
                               (t.task_id, kept, t.domain, now))
                    dups.append((t.task_id, kept))
                    ids.append(kept)
                    continue
                keys[(t.domain, key)] = t.task_id
                cfg = self._domains[t.domain].config if t.domain in self._domains else DomainConfig()
                lv = level if level is not None else level_of(cfg, t.difficulty)
                db.execute(
                    "INSERT INTO tasks (task_id, domain, split, difficulty, payload, state, created_at, content_key,"
                    " level, rnd) VALUES (?, ?, ?, ?, ?, 'registered', ?, ?, ?, ?)",
                    (t.task_id, t.domain, t.split, t.difficulty, payload, now, key, lv, self._rng.random()),
                )
                ids.append(t.task_id)
                new.append(t)
            if conflicts:
                raise TaskConflictError(conflicts)
        with self._lock:
            for d in {t.domain for t in new}:
                self._forget_order(d)
        self._load_domains()
        return Registration(ids, new, dups)

    @staticmethod
    def _stored_with(db: sqlite3.Connection, domain: str, key: str) -> str | None:
        row = db.execute("SELECT task_id FROM tasks WHERE domain = ? AND content_key = ?", (domain, key)).fetchone()
        return row["task_id"] if row else None

    def get_task(self, task_id: str) -> dict[str, Any] | None:
        """Summary of one task (``None`` when unknown); ``pass_rate`` is passes/samples or ``None``;
        ``state`` is ``retired`` once retired from training. Only when they say something: ``level``
        (not 0), ``flagged`` (True) and ``duplicate_of`` (the id asked for was posted as a duplicate of
        this task, whose summary this is)."""
        dup = self._one("SELECT duplicate_of FROM duplicates WHERE task_id = ?", task_id)
        row = self._one(
            "SELECT task_id, domain, split, state, samples, passes, groups_issued, level, retired, flagged"
            " FROM tasks WHERE task_id = ?", dup["duplicate_of"] if dup else task_id,
        )
        if row is None:
            return None
        d = dict(row)
        level, retired, flagged = d.pop("level"), d.pop("retired"), d.pop("flagged")
        d["pass_rate"] = d["passes"] / d["samples"] if d["samples"] else None
        if retired:
            d["state"] = "retired"
        if level:
            d["level"] = level
        if flagged:
            d["flagged"] = True
        if dup:
            d["duplicate_of"] = dup["duplicate_of"]
        return d

    def task_counts(self) -> dict[str, int]:
        """Registered tasks per split: ``{"train": n, "eval": n}``."""
        out = {"train": 0, "eval": 0}
        for row in self._all("SELECT split, COUNT(*) AS c FROM tasks GROUP BY split"):
            out[row["split"]] = row["c"]
        return out

    def samples_scored(self) -> int:
        """Scored samples over all tasks (infrastructure errors excluded)."""
        return int(self._one("SELECT COALESCE(SUM(samples), 0) AS s FROM tasks")["s"])

    def least_issued_train_tasks(self) -> list[str]:
        """Ids of the train tasks of unpaused domains with the fewest groups issued, sorted (empty when none)."""
        paused = list(self.paused_domains())
        marks = ",".join("?" * len(paused))
        active = f"split = 'train' AND retired = 0 AND domain NOT IN ({marks})"
        rows = self._all(
            f"SELECT task_id FROM tasks WHERE {active} AND groups_issued ="
            f" (SELECT MIN(groups_issued) FROM tasks WHERE {active}) ORDER BY task_id", *paused, *paused
        )
        return [r["task_id"] for r in rows]

    def learnable_train_tasks(self, domains: set[str] | None = None) -> list[tuple[str, float]]:
        """``(task_id, pass_rate)`` of train tasks with a pass rate strictly between 0 and 1 and no
        group in flight, sorted by id; only of ``domains`` when given."""
        rows = self._all(
            "SELECT t.task_id, t.domain, CAST(t.passes AS REAL) / t.samples AS p FROM tasks t WHERE t.split = 'train'"
            " AND t.retired = 0 AND t.samples > 0 AND t.passes > 0 AND t.passes < t.samples AND NOT EXISTS"
            ' (SELECT 1 FROM "groups" g WHERE g.task_id = t.task_id AND g.state = \'issued\') ORDER BY t.task_id'
        )
        return [(r["task_id"], float(r["p"])) for r in rows if domains is None or r["domain"] in domains]

    # ------------------------------------------------------------ groups

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

    def _samples(self, task: dict[str, Any]) -> int:
        """K of a training group of ``task`` (its stored JSON): its domain's ``samples_per_task``, else
        the task's own."""
        d = self._domains.get(task["domain"])
        return (d.config.samples_per_task if d else None) or task["samples_per_task"]

    def samples_of(self, task_id: str) -> int:
        """K of the next training group of ``task_id`` (see :meth:`_samples`)."""
        return self._samples(orjson.loads(self._one("SELECT payload FROM tasks WHERE task_id = ?", task_id)["payload"]))

    def _group(self, gid: str, payload: str, purpose: str, attempt: int, n: int, eval_round: int | None,
               mpv: int) -> IssuedGroup:
        task = orjson.loads(payload)
        d = self._domains.get(task["domain"])
        pool = task.get("pool") or (d.config.pool if d else "default")
        return IssuedGroup(gid, payload, purpose, attempt, n, eval_round, mpv, task["task_id"], task["domain"], pool,
                           d.config.max_tokens if d else None, d.config.temperature if d else None)

    def next_train_tasks(self, wanted: dict[str, tuple[int, int]]) -> dict[str, list[tuple[str, int, int]]]:
        """The next training tasks of each domain at a level: ``{domain: (level, k)}`` →
        ``{domain: [(task_id, samples, passes), ...]}``, up to k each, fewest groups first (ties in a
        random order drawn anew at every issue), retired tasks left out.

        Read ahead in blocks of at least :data:`_READ_AHEAD` per domain and level, kept in memory until a
        write changes the domain's order (a registration, a retirement, a re-levelling); an issued task
        leaves the block. ``samples``/``passes`` may lag by the rewards since the block was read.
        """
        out = {}
        with self._lock:
            for d, (level, k) in wanted.items():
                block = self._ahead.get(d, {}).get(level)
                if block is None or len(block) < k:
                    rows = self._db.execute(
                        "SELECT task_id, samples, passes FROM tasks WHERE domain = ? AND level = ? AND split = 'train'"
                        " AND retired = 0 ORDER BY groups_issued, rnd LIMIT ?", (d, level, max(k, _READ_AHEAD))
                    ).fetchall()
                    block = [(r["task_id"], r["samples"], r["passes"]) for r in rows]
                    self._ahead.setdefault(d, {})[level] = block
                out[d] = block[:k]
        return out

    def _forget_order(self, domain: str) -> None:
        """Drop the read-ahead blocks of ``domain`` (its order changed)."""
        self._ahead.pop(domain, None)

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

    # ------------------------------------------------------------ rewards

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

    # ------------------------------------------------------------ key/values

    def kv_get(self, key: str, default: Any = None) -> Any:
        """A JSON value stored under ``key`` (``default`` when absent)."""
        row = self._one("SELECT value FROM kv WHERE key = ?", key)
        return orjson.loads(row["value"]) if row else default

    def kv_set(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable ``value`` under ``key``."""
        with self._tx() as db:
            db.execute("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (key, orjson.dumps(value).decode()))

    @property
    def policy_version(self) -> int:
        """The highest policy version seen on flywheel.weights (0 before any)."""
        return int(self.kv_get("policy_version", 0))

    def raise_policy_version(self, version: int) -> bool:
        """Persist ``version`` when it is higher than the stored one; True when it changed."""
        with self._tx() as db:
            row = db.execute("SELECT value FROM kv WHERE key = 'policy_version'").fetchone()
            if row is not None and int(orjson.loads(row["value"])) >= version:
                return False
            db.execute("INSERT INTO kv (key, value) VALUES ('policy_version', ?)"
                       " ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(version),))
            return True
