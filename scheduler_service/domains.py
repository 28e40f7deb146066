"""Domains as first-class registry objects: config, pause, level, recent pass rate, spend, task lifecycle.

The :class:`DomainTables` mixin gives :class:`scheduler_service.registry.Registry` its domain tables
(one SQLite file, one lock). Every write goes through this process's registry, so the parsed domain
rows are cached in memory and refreshed after each write that changes them.

Tables: ``domains`` (config JSON, pause, curriculum window, generator batches), ``spend`` (what each
domain's samples cost, per purpose), ``duplicates`` (task ids posted with the content of another
task of the same domain) and ``domain_events`` (level moves, generated batches, pauses, retirements).
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from scheduler_service.config import AdaptiveSamples, DomainConfig
from shared.schemas import RewardEvent, Task

DOMAIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS domains (
    domain TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    applied TEXT,
    pause_reason TEXT,
    paused_at REAL,
    recent_pass REAL,
    level_samples INTEGER NOT NULL DEFAULT 0,
    batches TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS spend (
    domain TEXT NOT NULL,
    purpose TEXT NOT NULL,
    samples INTEGER NOT NULL DEFAULT 0,
    generated_tokens REAL NOT NULL DEFAULT 0,
    tool_rounds REAL NOT NULL DEFAULT 0,
    tool_seconds REAL NOT NULL DEFAULT 0,
    sandbox_seconds REAL NOT NULL DEFAULT 0,
    judge_calls REAL NOT NULL DEFAULT 0,
    verify_seconds REAL NOT NULL DEFAULT 0,
    groups INTEGER NOT NULL DEFAULT 0,
    group_seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (domain, purpose)
);
CREATE TABLE IF NOT EXISTS duplicates (
    task_id TEXT PRIMARY KEY,
    duplicate_of TEXT NOT NULL,
    domain TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS domain_events (
    id INTEGER PRIMARY KEY,
    domain TEXT NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL,
    at REAL NOT NULL
);
"""

COST_KEYS = ("generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls", "verify_seconds")
"""What a sample's ``RewardEvent.cost`` may hold, summed per domain in ``spend``."""

TASK_COLUMNS = {"content_key": "TEXT", "level": "INTEGER NOT NULL DEFAULT 0", "retired": "INTEGER NOT NULL DEFAULT 0",
                "flagged": "INTEGER NOT NULL DEFAULT 0", "pass_streak": "INTEGER NOT NULL DEFAULT 0",
                "groups_done": "INTEGER NOT NULL DEFAULT 0", "rnd": "REAL NOT NULL DEFAULT 0"}
"""Columns of ``tasks`` added by the domain layer (a registry written before it gains them on open)."""


_SPACE = re.compile(r"\s+")


def content_key(task: Task) -> str:
    """What makes two tasks of a domain the same task: sha1 of the domain, the split, the prompt (roles
    and text, lower-cased, whitespace collapsed) and the verifier spec (canonical JSON). The split is
    part of it so a held-out copy of a training task stays a separate task (the generators keep the
    splits disjoint; a submitter who wants that overlap gets it)."""
    prompt = "\n".join(m.role + ": " + _SPACE.sub(" ", m.content.strip().lower()) for m in task.prompt)
    spec = orjson.dumps(task.verifier.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha1(f"{task.domain}\0{task.split}\0{prompt}\0".encode() + spec).hexdigest()


def samples_for(samples: int, passes: int, cfg: AdaptiveSamples) -> int:
    """Samples of the next group of a task with ``passes`` of ``samples`` scored so far (see
    :class:`scheduler_service.config.AdaptiveSamples`): ``cfg.max`` while unknown or never passed,
    ``cfg.min`` when always passed, else the fewest n with 1 − pⁿ − (1 − p)ⁿ ≥ ``cfg.target``."""
    if samples == 0 or passes == 0:
        return cfg.max
    p = passes / samples
    if passes >= samples:
        return cfg.min
    for n in range(cfg.min, cfg.max + 1):
        if 1.0 - p ** n - (1.0 - p) ** n >= cfg.target:
            return n
    return cfg.max


def spent_on(key: str, train: dict[str, float]) -> float:
    """A domain's training spend against budget cap ``key`` (``sandbox_seconds`` counts the tool loop's
    sandbox seconds and the unit tests' together)."""
    return train.get(key, 0.0) + (train.get("tool_seconds", 0.0) if key == "sandbox_seconds" else 0.0)


def level_of(cfg: DomainConfig, difficulty: float) -> int:
    """Level of a fixed-data task: the first level whose ``difficulty`` range holds it; 0 when no level
    has a range; -1 when none holds it (never issued)."""
    if not cfg.levels or all(lv.difficulty is None for lv in cfg.levels):
        return 0
    for i, lv in enumerate(cfg.levels):
        if lv.difficulty is not None and lv.difficulty[0] <= difficulty <= lv.difficulty[1]:
            return i
    return -1


@dataclass
class DomainRow:
    """One domain as stored: its config plus what the scheduler keeps about it."""

    name: str
    config: DomainConfig
    applied: str | None = None
    """sha1 of the YAML entry last applied (``None``: created by a task or over REST)."""
    pause_reason: str | None = None
    """Set when the verifier found the domain's spec broken (or an operator paused it by resume's twin)."""
    paused_at: float | None = None
    recent_pass: float | None = None
    """Moving average of passes of the current level's scored training samples (``None``: none yet)."""
    level_samples: int = 0
    """Scored training samples of the current level since the domain entered it."""
    batches: dict[str, int] = field(default_factory=dict)
    """Generator batches made per ``"<split>:<level>"`` (seeds the next; ``-1``: the generator ran dry)."""

    @property
    def issuable(self) -> bool:
        """Active, not paused by the verifier, with a positive weight."""
        return self.config.state == "active" and self.pause_reason is None and self.config.weight > 0

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> "DomainRow":
        return cls(r["domain"], DomainConfig.model_validate_json(r["config"]), r["applied"], r["pause_reason"],
                   r["paused_at"], r["recent_pass"], r["level_samples"], orjson.loads(r["batches"]))


def config_hash(cfg: DomainConfig) -> str:
    """sha1 of a config's canonical JSON (what ``applied`` compares)."""
    return hashlib.sha1(orjson.dumps(cfg.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()


class DomainTables:
    """Domain methods of the registry (a mixin: needs ``_tx``, ``_one``, ``_all`` and ``_lock``)."""

    _domains: dict[str, DomainRow]
    _window_moves: dict[str, tuple[float, int]]
    """Curriculum windows moved by the open transaction: ``{domain: (recent pass EMA, level samples)}``."""
    _moved: set[str]

    # ------------------------------------------------------------ rows

    def _load_domains(self) -> None:
        self._window_moves, self._moved = {}, set()
        with self._lock:
            self._domains = {r["domain"]: DomainRow.from_sql(r) for r in self._db.execute("SELECT * FROM domains")}

    def _apply_windows(self) -> None:
        """After a committed reward: the cached rows take the curriculum windows it moved (a level move
        re-reads its row)."""
        with self._lock:
            for domain, (ema, n) in self._window_moves.items():
                row = self._domains.get(domain)
                if row is not None:
                    row.recent_pass, row.level_samples = ema, n
            moved, self._window_moves, self._moved = self._moved, {}, set()
        for domain in moved:
            self._refresh(domain)

    def _refresh(self, domain: str) -> None:
        row = self._one("SELECT * FROM domains WHERE domain = ?", domain)
        with self._lock:
            if row is None:
                self._domains.pop(domain, None)
            else:
                self._domains[domain] = DomainRow.from_sql(row)

    def _write_domain(self, db: sqlite3.Connection, name: str, cfg: DomainConfig, applied: str | None = None,
                      keep_applied: bool = True) -> None:
        now = time.time()
        db.execute(
            "INSERT INTO domains (domain, config, applied, created_at, updated_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT(domain) DO UPDATE SET config = excluded.config, updated_at = excluded.updated_at"
            + ("" if keep_applied else ", applied = excluded.applied"),
            (name, cfg.model_dump_json(), applied, now, now),
        )

    def _event(self, db: sqlite3.Connection, domain: str, kind: str, **detail: Any) -> None:
        db.execute("INSERT INTO domain_events (domain, kind, detail, at) VALUES (?, ?, ?, ?)",
                   (domain, kind, orjson.dumps(detail).decode(), time.time()))

    def domain(self, name: str) -> DomainRow | None:
        """The stored row of domain ``name`` (``None`` when unknown)."""
        with self._lock:
            return self._domains.get(name)

    def domain_rows(self) -> dict[str, DomainRow]:
        """Every domain's row, by name (a snapshot)."""
        with self._lock:
            return dict(self._domains)

    def _ensure_domains(self, db: sqlite3.Connection, names: set[str]) -> None:
        """Create rows with the default config for domains first seen in a task batch."""
        for name in names - set(self._domains):
            if db.execute("SELECT 1 FROM domains WHERE domain = ?", (name,)).fetchone() is None:
                self._write_domain(db, name, DomainConfig())

    def put_domain(self, name: str, cfg: DomainConfig) -> bool:
        """Create or replace domain ``name``'s config (one transaction); a level change restarts the
        curriculum window, new difficulty ranges re-level a fixed-data domain's tasks. Returns True when
        the domain was created."""
        old = self.domain(name)
        with self._tx() as db:
            self._write_domain(db, name, cfg)
            self._on_config_change(db, name, old.config if old else None, cfg)
        self._refresh(name)
        return old is None

    def apply_configured(self, domains: dict[str, DomainConfig]) -> list[str]:
        """Apply the config file's ``domains``: an unknown domain, or one whose entry changed since it was
        last applied, takes the file's config; otherwise the stored one (REST changes) is kept.

        An environment domain about to be (re)applied is checked first
        (:func:`scheduler_service.generate.check_environment`), so a config naming an environment that cannot be
        loaded stops the scheduler at start, naming the domain, and changes nothing.

        Returns:
            The names whose config was (re)applied.

        Raises:
            ValueError: an environment domain cannot be loaded (the message names ``domains.<name>.<field>`` and
                the module, file, attribute or column).
        """
        from scheduler_service.generate import check_environment

        todo = {name: cfg for name, cfg in domains.items()
                if name not in self._domains or self._domains[name].applied != config_hash(cfg)}
        problems = [f"domains.{name}.{'.'.join(map(str, loc))}: {msg}"
                    for name, cfg in todo.items() for loc, msg in check_environment(name, cfg)]
        if problems:
            raise ValueError("the config's domains cannot be applied: " + "; ".join(problems))
        done = []
        with self._tx() as db:
            for name, cfg in todo.items():
                h = config_hash(cfg)
                old = self._domains.get(name)
                self._write_domain(db, name, cfg, applied=h, keep_applied=False)
                self._on_config_change(db, name, old.config if old else None, cfg)
                done.append(name)
        self._load_domains()
        return done

    def _on_config_change(self, db: sqlite3.Connection, name: str, old: DomainConfig | None,
                          new: DomainConfig) -> None:
        if old is not None and old.level != new.level:
            db.execute("UPDATE domains SET recent_pass = NULL, level_samples = 0 WHERE domain = ?", (name,))
            self._event(db, name, "level", old=old.level, new=new.level, by="config")
        if not new.makes_tasks and (old is None or old.levels != new.levels):
            self._relevel(db, name, new)

    def _relevel(self, db: sqlite3.Connection, name: str, cfg: DomainConfig) -> None:
        """Level of every task of a fixed-data domain from its difficulty (:func:`level_of`)."""
        self._forget_order(name)
        if not cfg.levels or all(lv.difficulty is None for lv in cfg.levels):
            db.execute("UPDATE tasks SET level = 0 WHERE domain = ?", (name,))
            return
        cases = " ".join("WHEN difficulty BETWEEN ? AND ? THEN ?" for lv in cfg.levels if lv.difficulty)
        args = [x for i, lv in enumerate(cfg.levels) if lv.difficulty for x in (*lv.difficulty, i)]
        db.execute(f"UPDATE tasks SET level = CASE {cases} ELSE -1 END WHERE domain = ?", (*args, name))

    def record_batch(self, domain: str, key: str, new: int) -> None:
        """Count a generator batch ``key`` (``"<split>:<level>"``) of ``domain`` that stored ``new`` tasks;
        a training batch with nothing new marks the level dry (``-1``: no more batches there)."""
        with self._tx() as db:
            row = db.execute("SELECT batches FROM domains WHERE domain = ?", (domain,)).fetchone()
            batches = orjson.loads(row["batches"]) if row else {}
            dry = new == 0 and key.startswith("train:")
            batches[key] = -1 if dry else max(batches.get(key, 0), 0) + 1
            db.execute("UPDATE domains SET batches = ? WHERE domain = ?", (orjson.dumps(batches).decode(), domain))
            self._event(db, domain, "generated", batch=key, new=new, dry=dry)
        self._refresh(domain)

    # ------------------------------------------------------------ pause

    def paused_domains(self) -> dict[str, dict[str, Any]]:
        """Domains whose training groups are not issued: ``{domain: {"reason", "since"}}`` (a verifier
        report, or the config's state ``paused``/``retired``)."""
        out = {}
        for name, d in self.domain_rows().items():
            if d.pause_reason is not None:
                out[name] = {"reason": d.pause_reason, "since": d.paused_at}
            elif d.config.state != "active":
                out[name] = {"reason": f"state {d.config.state}", "since": None}
        return out

    def pause_domain(self, domain: str, reason: str, task_id: str | None = None) -> bool:
        """Stop issuing training groups of ``domain`` because its spec is broken (``task_id`` shows it);
        False when it was already paused for a reason."""
        with self._tx() as db:
            self._ensure_domains(db, {domain})
            cur = db.execute("UPDATE domains SET pause_reason = ?, paused_at = ? WHERE domain = ?"
                             " AND pause_reason IS NULL", (reason, time.time(), domain))
            if cur.rowcount:
                self._event(db, domain, "paused", reason=reason, task_id=task_id)
        self._refresh(domain)
        return bool(cur.rowcount)

    def resume_domain(self, domain: str) -> bool:
        """Issue ``domain``'s groups again (clears a verifier pause and a ``paused`` state); False when
        it was not paused."""
        d = self.domain(domain)
        if d is None or (d.pause_reason is None and d.config.state != "paused"):
            return False
        with self._tx() as db:
            db.execute("UPDATE domains SET pause_reason = NULL, paused_at = NULL WHERE domain = ?", (domain,))
            if d.config.state == "paused":
                self._write_domain(db, domain, d.config.model_copy(update={"state": "active"}))
            self._event(db, domain, "resumed")
        self._refresh(domain)
        return True

    # ------------------------------------------------------------ what rewards do to a domain

    def _account(self, db: sqlite3.Connection, ev: RewardEvent) -> None:
        """Add one counted sample's cost to its domain's spend (per purpose)."""
        vals = [float(ev.cost.get(k, 0.0)) for k in COST_KEYS]
        if "generated_tokens" not in ev.cost:
            vals[0] = float(ev.completion_tokens)
        sets = ", ".join(f"{k} = {k} + excluded.{k}" for k in COST_KEYS)
        db.execute(f"INSERT INTO spend (domain, purpose, samples, {', '.join(COST_KEYS)}) VALUES (?, ?, 1,"
                   f" {', '.join('?' * len(COST_KEYS))}) ON CONFLICT(domain, purpose) DO UPDATE SET"
                   f" samples = samples + 1, {sets}", (ev.domain, ev.purpose, *vals))

    def _curriculum(self, db: sqlite3.Connection, domain: str, task_level: int, passed: bool) -> str | None:
        """Feed one scored training sample of ``domain`` to its level's window; move the level when the
        curriculum says so (see :class:`scheduler_service.config.CurriculumConfig`). Returns a log line
        when the level moved."""
        d = self._tx_domain(db, domain)
        if d is None or task_level != d.config.level:
            return None
        cur = d.config.curriculum
        alpha = 2.0 / (cur.window + 1)
        ema = float(passed) if d.recent_pass is None else d.recent_pass + alpha * (float(passed) - d.recent_pass)
        n = d.level_samples + 1
        levels = len(d.config.levels or [None])
        move = 0
        if cur.mode == "adaptive" and n >= cur.min_samples:
            if ema >= cur.promote_above and d.config.level + 1 < levels:
                move = 1
            elif ema < cur.demote_below and d.config.level > 0:
                move = -1
        if not move:
            db.execute("UPDATE domains SET recent_pass = ?, level_samples = ? WHERE domain = ?", (ema, n, domain))
            self._window_moves[domain] = (ema, n)  # applied to the cached row once the transaction commits
            return None
        new = d.config.model_copy(update={"level": d.config.level + move})
        self._write_domain(db, domain, new)
        db.execute("UPDATE domains SET recent_pass = NULL, level_samples = 0 WHERE domain = ?", (domain,))
        self._moved.add(domain)
        kind = "promoted" if move > 0 else "demoted"
        self._event(db, domain, kind, old=d.config.level, new=new.level,
                    recent_pass=round(ema, 4), samples=n)
        return f"domain {domain} {kind} to level {new.level} (recent pass rate {ema:.2f} over {n} samples)"

    def _tx_domain(self, db: sqlite3.Connection, domain: str) -> DomainRow | None:
        """``domain``'s row as the open transaction sees it: the cached row with the curriculum window that
        earlier rewards of the same transaction moved (:meth:`Registry.record_rewards` records a batch in one),
        re-read from ``db`` once its level moved in it."""
        if domain in self._moved:
            r = db.execute("SELECT * FROM domains WHERE domain = ?", (domain,)).fetchone()
            return DomainRow.from_sql(r) if r is not None else None
        d = self._domains.get(domain)
        if d is not None and domain in self._window_moves:
            ema, n = self._window_moves[domain]
            return replace(d, recent_pass=ema, level_samples=n)
        return d

    def _lifecycle(self, db: sqlite3.Connection, g: sqlite3.Row, now: float) -> str | None:
        """Account a completed training group for its task's lifecycle and its domain's group cost.

        The task's pass streak grows when every sample passed (it resets on any failure; infrastructure
        errors leave it); at ``lifecycle.retire_after`` it is retired from training; a task with no pass
        after ``lifecycle.flag_after`` groups is flagged. Returns a log line when the task changed.
        """
        t = db.execute("SELECT domain, passes, pass_streak, groups_done, retired, flagged FROM tasks"
                       " WHERE task_id = ?", (g["task_id"],)).fetchone()
        rows = db.execute("SELECT passed, infra_error FROM rewards WHERE group_id = ? AND counted = 1",
                          (g["group_id"],)).fetchall()
        db.execute("INSERT INTO spend (domain, purpose, groups, group_seconds) VALUES (?, ?, 1, ?) ON CONFLICT"
                   " (domain, purpose) DO UPDATE SET groups = groups + 1, group_seconds = group_seconds +"
                   " excluded.group_seconds", (t["domain"], g["purpose"], max(0.0, now - (g["issued_at"] or now))))
        if g["purpose"] != "train":
            return None
        infra = any(r["infra_error"] for r in rows)
        streak = t["pass_streak"] if infra else (t["pass_streak"] + 1 if all(r["passed"] for r in rows) else 0)
        done = t["groups_done"] + 1
        lc = (self._domains.get(t["domain"]) or DomainRow(t["domain"], DomainConfig())).config.lifecycle
        retire = int(t["retired"] or (lc.retire_after > 0 and streak >= lc.retire_after))
        flag = int(t["flagged"] or (lc.flag_after > 0 and t["passes"] == 0 and done >= lc.flag_after))
        db.execute("UPDATE tasks SET pass_streak = ?, groups_done = ?, retired = ?, flagged = ? WHERE task_id = ?",
                   (streak, done, retire, flag, g["task_id"]))
        if retire and not t["retired"]:
            self._forget_order(t["domain"])
            return f"task {g['task_id']} retired from training: every sample passed in its last {streak} groups"
        if flag and not t["flagged"]:
            return f"task {g['task_id']} flagged: no sample passed in {done} groups"
        return None

    # ------------------------------------------------------------ views

    def spend(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{domain: {purpose: {samples, generated_tokens, ..., groups, group_seconds}}}``."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for r in self._all("SELECT * FROM spend"):
            d = dict(r)
            out.setdefault(d.pop("domain"), {})[d.pop("purpose")] = d
        return out

    def in_flight_by_domain(self) -> dict[str, tuple[int, int]]:
        """``{domain: (groups, samples still to come)}`` of training groups pending or issued."""
        rows = self._all("SELECT domain, COUNT(*) AS g, COALESCE(SUM(n - received), 0) AS s FROM \"groups\""
                         " WHERE state IN ('pending', 'issued') AND purpose = 'train' AND dropped IS NULL"
                         " GROUP BY domain")
        return {r["domain"]: (int(r["g"]), int(r["s"])) for r in rows if r["domain"] is not None}

    def task_summary(self) -> dict[str, dict[str, Any]]:
        """Per domain: tasks per split, live (train, not retired) tasks per level, retired, flagged,
        duplicates reported, and mix-issued training groups."""
        out: dict[str, dict[str, Any]] = {}

        def row(d: str) -> dict[str, Any]:
            return out.setdefault(d, {"train": 0, "eval": 0, "live_by_level": {}, "retired": 0, "flagged": 0,
                                      "duplicates": 0, "groups_issued": 0})

        for r in self._all("SELECT domain, split, level, retired, flagged, COUNT(*) AS c FROM tasks"
                           " GROUP BY domain, split, level, retired, flagged"):
            s = row(r["domain"])
            s[r["split"]] += r["c"]
            if r["split"] == "train":
                s["retired"] += r["c"] if r["retired"] else 0
                s["flagged"] += r["c"] if r["flagged"] else 0
                if not r["retired"]:
                    s["live_by_level"][r["level"]] = s["live_by_level"].get(r["level"], 0) + r["c"]
        for r in self._all("SELECT domain, COUNT(*) AS c FROM duplicates GROUP BY domain"):
            row(r["domain"])["duplicates"] = r["c"]
        for r in self._all("SELECT domain, COUNT(*) AS c FROM \"groups\" WHERE purpose = 'train' AND"
                           " resample_of IS NULL GROUP BY domain"):
            if r["domain"] is not None:
                row(r["domain"])["groups_issued"] = r["c"]
        return out

    def domain_events(self, domain: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The latest events (level moves, generated batches, pauses), newest last."""
        rows = self._all("SELECT * FROM domain_events WHERE (? IS NULL OR domain = ?) ORDER BY id DESC LIMIT ?",
                         domain, domain, limit)
        return [{"domain": r["domain"], "kind": r["kind"], "at": r["at"], **orjson.loads(r["detail"])}
                for r in reversed(rows)]

    def task_list(self, domain: str, what: str, limit: int = 100) -> list[str]:
        """Ids of a domain's ``retired`` or ``flagged`` training tasks, or of its posted ``duplicates``."""
        if what == "duplicates":
            rows = self._all("SELECT task_id FROM duplicates WHERE domain = ? ORDER BY task_id LIMIT ?", domain, limit)
        else:
            col = {"retired": "retired", "flagged": "flagged"}[what]
            rows = self._all(f"SELECT task_id FROM tasks WHERE domain = ? AND split = 'train' AND {col} = 1"
                             " ORDER BY task_id LIMIT ?", domain, limit)
        return [r["task_id"] for r in rows]
