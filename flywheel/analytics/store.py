"""The analytics database (:class:`Store`): one DuckDB file with a table per record type, ``rejected``,
``ingest_offsets`` and the :data:`VIEWS`; each batch is written in one transaction with the partitions' next
offsets. :func:`connect` waits while another process holds the file's lock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Mapping

import duckdb
import orjson

from flywheel.analytics.tables import KAFKA_COLUMNS, REJECTED, TABLES, TableSpec


VIEWS = {
    "samples": """
        SELECT * FROM rewards
        QUALIFY row_number() OVER (PARTITION BY trajectory_id ORDER BY kafka_time DESC, kafka_offset DESC) = 1""",
    "evals": """
        SELECT kafka_topic, kafka_partition, kafka_offset, source, policy_version, domain, time,
               CAST(max(value) FILTER (WHERE name = 'eval/round') AS BIGINT) AS eval_round,
               max(value) FILTER (WHERE name = 'eval/accuracy') AS accuracy,
               CAST(max(value) FILTER (WHERE name = 'eval/n') AS BIGINT) AS n,
               map_from_entries(list((name, value) ORDER BY name)) AS eval_values
        FROM metrics WHERE name LIKE 'eval/%'
        GROUP BY kafka_topic, kafka_partition, kafka_offset, source, policy_version, domain, time""",
}
"""Views made at open: ``samples`` (``rewards`` with one row per ``trajectory_id``, its latest score: the
one the five questions use) and ``evals`` (one row per eval record on flywheel.metrics: ``domain`` NULL
for the run-wide one). ``metrics_wide`` (one column per metric name) is remade after each ingest."""


def _struct(spec: TableSpec) -> str:
    """The ``from_json`` structure of a table's rows: ``[{"col": "TYPE", ...}]``."""
    return orjson.dumps([dict((*KAFKA_COLUMNS, *spec.columns))]).decode()


class Store:
    """The analytics database: one table per :data:`TABLES` entry, ``rejected``, ``ingest_offsets``, the
    :data:`VIEWS`. Not thread-safe; one writer process at a time (DuckDB locks the file)."""

    def __init__(self, path: str | Path, specs: Iterable[TableSpec] = TABLES) -> None:
        self.path = Path(path)
        self.specs = {s.name: s for s in (*specs, REJECTED)}
        self.con: duckdb.DuckDBPyConnection | None = None

    def open(self, lock_wait_s: float = 10.0) -> "Store":
        """Connect (creating the file, its tables and views when new; adding columns a newer record type has),
        retrying for ``lock_wait_s`` seconds while another process holds the file: a ``flywheel analytics
        query`` that opened it during a ``--follow`` ingest's pause (before, the ingest crashed then).

        Raises:
            duckdb.IOException: another process still holds the file after ``lock_wait_s`` seconds, or the file
                cannot be opened at all (not a DuckDB file: at once).
        """
        if self.con is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = self.con = connect(self.path, lock_wait_s=lock_wait_s)
        have = set(con.execute("SELECT table_name, column_name FROM information_schema.columns").fetchall())
        for s in self.specs.values():
            cols = ", ".join(f"{n} {t}" for n, t in (*KAFKA_COLUMNS, *s.columns))
            pk = ", ".join(("kafka_topic", "kafka_partition", "kafka_offset", *s.key))
            con.execute(f"CREATE TABLE IF NOT EXISTS {s.name} ({cols}, PRIMARY KEY ({pk}))")
            for n, t in s.columns:
                if (s.name, n) not in have and any(table == s.name for table, _ in have):
                    con.execute(f"ALTER TABLE {s.name} ADD COLUMN {n} {t}")  # a field newer than the file
        con.execute("CREATE TABLE IF NOT EXISTS ingest_offsets (kafka_topic VARCHAR, kafka_partition INTEGER, "
                    "next_offset BIGINT NOT NULL, last_digest VARCHAR NOT NULL, updated DOUBLE, "
                    "PRIMARY KEY (kafka_topic, kafka_partition))")
        if not have:  # a new file (views of an existing one are made again after each ingest)
            self._make_views()
        return self

    def _make_views(self) -> None:
        for name, sql in VIEWS.items():
            self.con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")

    def close(self) -> None:
        """Close the connection (the next :meth:`write` opens it again)."""
        if self.con is not None:
            self.con.close()
            self.con = None

    def offsets(self) -> dict[tuple[str, int], tuple[int, str]]:
        """Stored ``(topic, partition) → (next offset, digest of the record before it)``."""
        rows = self.open().con.execute("SELECT kafka_topic, kafka_partition, next_offset, last_digest "
                                       "FROM ingest_offsets").fetchall()
        return {(t, p): (n, d) for t, p, n, d in rows}

    def write(self, rows: Mapping[str, list[dict]],
              positions: Mapping[tuple[str, int], tuple[int, str]]) -> dict[str, int]:
        """Insert ``rows`` (by table; those already there are skipped) and store ``positions`` (next offset
        and digest per partition) in one transaction; returns the rows inserted per table.

        Raises:
            duckdb.Error: the transaction failed and was rolled back (nothing of the batch is stored).
        """
        con = self.open().con
        con.begin()
        try:
            added = {name: self._insert(name, rs) for name, rs in rows.items() if rs}
            self._store_positions(positions)
            con.commit()
        except BaseException:
            con.rollback()
            raise
        return added

    def _insert(self, name: str, rows: list[dict]) -> int:
        spec = self.specs[name]
        sql = (f"INSERT INTO {name} BY NAME SELECT unnest(r) FROM "
               f"(SELECT unnest(from_json(?::JSON, '{_struct(spec)}')) AS r) ON CONFLICT DO NOTHING")
        return self.con.execute(sql, [orjson.dumps(rows).decode()]).fetchone()[0]

    def _store_positions(self, positions: Mapping[tuple[str, int], tuple[int, str]]) -> None:
        now = time.time()
        for (t, p), (n, d) in positions.items():
            self.con.execute(
                "INSERT INTO ingest_offsets VALUES (?, ?, ?, ?, ?) ON CONFLICT (kafka_topic, kafka_partition) "
                "DO UPDATE SET next_offset = excluded.next_offset, last_digest = excluded.last_digest, "
                "updated = excluded.updated", [t, p, n, d, now])

    def refresh_views(self) -> None:
        """(Re)make the :data:`VIEWS` and ``metrics_wide``: one row per metrics record, one ``DOUBLE`` column
        per metric name seen (DuckDB views need the names spelled out)."""
        con = self.open().con
        self._make_views()
        names = [n for (n,) in con.execute("SELECT DISTINCT name FROM metrics ORDER BY name").fetchall()]
        keys = "kafka_topic, kafka_partition, kafka_offset, kafka_time, source, step, policy_version, domain, time"
        if names:
            listed = ", ".join("'" + n.replace("'", "''") + "'" for n in names)
            sql = f"PIVOT metrics ON name IN ({listed}) USING first(value) GROUP BY {keys}"
        else:
            sql = f"SELECT DISTINCT {keys} FROM metrics"
        con.execute(f"CREATE OR REPLACE VIEW metrics_wide AS {sql}")

    def counts(self) -> dict[str, int]:
        """Rows per table."""
        con = self.open().con
        return {n: con.execute(f"SELECT count(*) FROM {n}").fetchone()[0] for n in self.specs}


def connect(db: str | Path, read_only: bool = False, lock_wait_s: float = 10.0) -> duckdb.DuckDBPyConnection:
    """Connect to the DuckDB file ``db``, retrying every 0.2 s for ``lock_wait_s`` seconds while another process
    holds its lock (DuckDB: one writing process, or any number of reading ones). Blocks the calling thread.

    Raises:
        duckdb.IOException: the lock is still held after ``lock_wait_s`` seconds, or the file cannot be opened
            for another reason (raised at once: not a DuckDB file, say).
    """
    deadline = time.monotonic() + lock_wait_s
    while True:
        try:
            return duckdb.connect(str(db), read_only=read_only)
        except duckdb.IOException as e:
            if "Could not set lock" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
