"""The registry's ``tasks`` table: registering batches, task summaries and the order training tasks are drawn in.

The :class:`TaskTables` mixin gives :class:`scheduler_service.registry.Registry` its task methods. A task is
stored once per content (:func:`scheduler_service.domains.content_key`); its row carries its pass rate
(``samples``/``passes``), how many groups were issued for it, its curriculum level and a random rank that
breaks ties in the fewest-groups-first order (read ahead in memory per domain and level).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import orjson

from scheduler_service.config import DomainConfig
from scheduler_service.domains import content_key, level_of
from shared.schemas import Task

TASK_SCHEMA = """
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
"""

_READ_AHEAD = 64
"""Training tasks read ahead per domain and level (:meth:`Registry.next_train_tasks`)."""


class TaskConflictError(ValueError):
    """Some task ids of a batch are already registered (or repeated in the batch) with other content."""

    def __init__(self, task_ids: list[str]) -> None:
        super().__init__(f"task ids registered with different content: {', '.join(task_ids[:20])}")
        self.task_ids = task_ids


@dataclass(frozen=True)
class Registration:
    """What :meth:`Registry.register` did with a batch: ``task_ids[i]`` is the id the i-th task is
    stored under (its own, or for a duplicate the task it duplicates); ``new``: the tasks stored now;
    ``duplicates``: ``(posted id, id of the stored task with the same content)``."""

    task_ids: list[str]
    new: list[Task]
    duplicates: list[tuple[str, str]]


def canonical_payload(task: Task) -> str:
    """The stored JSON of ``task`` (sorted keys, so equal content gives equal text)."""
    return orjson.dumps(task.model_dump(mode="json", by_alias=True), option=orjson.OPT_SORT_KEYS).decode()


class TaskTables:
    """Task methods of the registry (a mixin: needs ``_tx``, ``_one``, ``_all``, ``_lock``, ``_db``, ``_rng``,
    ``_ahead`` and the domain rows of :class:`scheduler_service.domains.DomainTables`)."""

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

    def _samples(self, task: dict[str, Any]) -> int:
        """K of a training group of ``task`` (its stored JSON): its domain's ``samples_per_task``, else
        the task's own."""
        d = self._domains.get(task["domain"])
        return (d.config.samples_per_task if d else None) or task["samples_per_task"]

    def samples_of(self, task_id: str) -> int:
        """K of the next training group of ``task_id`` (see :meth:`_samples`)."""
        return self._samples(orjson.loads(self._one("SELECT payload FROM tasks WHERE task_id = ?", task_id)["payload"]))

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
