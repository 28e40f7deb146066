"""The scheduler's task registry: SQLite through the stdlib ``sqlite3`` module.

What must survive a broker loss lives here (DESIGN.md, "Delivery semantics"): tasks, their
pass rates, the groups issued for them, the reward events already counted and the policy version.
One connection in WAL mode with ``synchronous=FULL``, shared by the event loop and worker
threads under a lock; every call is one short transaction.

:class:`Registry` opens the file, creates and migrates the schema, and holds the ``kv`` table (the policy
version and other key/values); one mixin per table family gives it the rest: tasks
(:mod:`scheduler_service.task_store`), groups (:mod:`scheduler_service.group_store`), rewards and eval rounds
(:mod:`scheduler_service.reward_store`), domains (:mod:`scheduler_service.domains`) and the drift monitor's
alerts and breakers (:mod:`scheduler_service.monitor_store`).
"""

from __future__ import annotations

import random
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import orjson

from scheduler_service.domains import DOMAIN_SCHEMA, TASK_COLUMNS, DomainTables
from scheduler_service.group_store import GROUP_SCHEMA, GroupTables
from scheduler_service.monitor_store import MONITOR_SCHEMA, MonitorTables
from scheduler_service.reward_store import REWARD_SCHEMA, RewardTables
from scheduler_service.task_store import TASK_SCHEMA, TaskTables
from shared.config import RunConfig

_PAUSED_KEY = "paused_domains"
"""Where registries written before domains had their own table kept the paused ones (moved on open)."""

_KV_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_SCHEMA = TASK_SCHEMA + GROUP_SCHEMA + REWARD_SCHEMA + _KV_SCHEMA + DOMAIN_SCHEMA + MONITOR_SCHEMA

_INDEXES = """
CREATE INDEX IF NOT EXISTS tasks_pick ON tasks (domain, level, groups_issued, rnd) WHERE split = 'train' AND retired = 0;
CREATE INDEX IF NOT EXISTS tasks_content ON tasks (domain, content_key);
CREATE INDEX IF NOT EXISTS groups_domain ON "groups" (domain, state);
"""


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


class Registry(TaskTables, GroupTables, RewardTables, DomainTables, MonitorTables):
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
