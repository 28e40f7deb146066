"""The drift monitor's durable state in the registry: alerts (history and which fire), breakers, the run-wide
threshold overrides and the run-wide training pause (a mixin of ``scheduler_service.registry.Registry``)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from scheduler_service.breaker import Breaker
from shared.schemas import Alert

MONITOR_SCHEMA = """
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    domain TEXT,
    signal TEXT NOT NULL,
    status TEXT NOT NULL,
    severity TEXT NOT NULL,
    record TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS alerts_by_key ON alerts (key, id);
CREATE TABLE IF NOT EXISTS breakers (
    domain TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""

_OVERRIDES_KEY = "monitor_overrides"
_PAUSE_KEY = "training_paused"
_ALERTS_KEPT = 100_000


class MonitorTables:
    """Alert, breaker and run-control methods of the registry (a mixin: needs ``_tx``, ``_all``, ``_one``,
    ``kv_get``, ``kv_set`` and ``_event``)."""

    def record_alerts(self, alerts: list[Alert]) -> None:
        """Store ``alerts`` (one transaction); breaker alerts are also domain events. Keeps the newest
        100,000 records."""
        if not alerts:
            return
        with self._tx() as db:
            for a in alerts:
                db.execute("INSERT INTO alerts (key, domain, signal, status, severity, record, at) VALUES"
                           " (?, ?, ?, ?, ?, ?, ?)", (a.key, a.domain, a.signal, a.status, a.severity,
                                                      a.encode().decode(), a.time))
                if a.domain is not None and a.signal == "breaker":
                    self._event(db, a.domain, f"breaker_{a.details.get('state')}", trigger=a.details.get("trigger"))
            db.execute("DELETE FROM alerts WHERE id <= (SELECT MAX(id) FROM alerts) - ?", (_ALERTS_KEPT,))

    def active_alerts(self) -> list[Alert]:
        """Alerts firing now (the newest record per key is ``firing``), oldest first."""
        rows = self._all("SELECT record FROM alerts WHERE id IN (SELECT MAX(id) FROM alerts GROUP BY key)"
                         " AND status = 'firing' ORDER BY id")
        return [Alert.model_validate_json(r["record"]) for r in rows]

    def alert_history(self, domain: str | None = None, severity: str | None = None, signal: str | None = None,
                      limit: int = 100) -> list[Alert]:
        """The newest ``limit`` alert records (firing and resolved), newest first, optionally of one domain,
        severity or signal."""
        where, args = [], []
        for col, v in (("domain", domain), ("severity", severity), ("signal", signal)):
            if v is not None:
                where.append(f"{col} = ?")
                args.append(v)
        sql = "SELECT record FROM alerts" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._all(sql + " ORDER BY id DESC LIMIT ?", *args, limit)
        return [Alert.model_validate_json(r["record"]) for r in rows]

    def save_breakers(self, breakers: dict[str, Breaker]) -> None:
        """Persist changed breakers (one transaction)."""
        if not breakers:
            return
        now = time.time()
        with self._tx() as db:
            for d, b in breakers.items():
                db.execute("INSERT INTO breakers (domain, state, record, updated_at) VALUES (?, ?, ?, ?) ON CONFLICT"
                           "(domain) DO UPDATE SET state = excluded.state, record = excluded.record,"
                           " updated_at = excluded.updated_at", (d, b.state, orjson.dumps(b.to_dict()).decode(), now))

    def breakers(self) -> dict[str, Breaker]:
        """Every stored breaker by domain."""
        return {r["domain"]: Breaker(**orjson.loads(r["record"])) for r in self._all("SELECT * FROM breakers")}

    def run_overrides(self) -> dict[str, dict[str, Any]]:
        """Run-wide threshold overrides set by ``set_threshold`` without a domain."""
        return self.kv_get(_OVERRIDES_KEY, {})

    def set_run_overrides(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Replace the run-wide threshold overrides."""
        self.kv_set(_OVERRIDES_KEY, overrides)

    def training_pause(self) -> dict[str, Any] | None:
        """``{"reason", "since", "by"}`` while training is paused run-wide, else ``None``."""
        return self.kv_get(_PAUSE_KEY)

    def set_training_pause(self, pause: dict[str, Any] | None) -> None:
        """Pause (a dict) or resume (``None``) training run-wide."""
        self.kv_set(_PAUSE_KEY, pause)
