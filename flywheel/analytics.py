"""``flywheel analytics``: the topics into DuckDB, incrementally and idempotently.

    flywheel analytics [--run-dir D] [--bootstrap HOST:PORT] [--db PATH] [--follow]
    flywheel analytics query "SELECT domain, count(*) FROM rewards GROUP BY ALL" [--json]

One table per record type, with typed columns (:data:`TABLES`), each keyed by the record's Kafka
coordinates ``(kafka_topic, kafka_partition, kafka_offset)`` (``metrics`` adds ``name``: it is stored long,
one row per value):

=============  =====================  ================================================================
table          topic                  one row per
=============  =====================  ================================================================
tasks          flywheel.tasks         registered task (a re-registration is a second row)
rewards        flywheel.rewards       scored sample (a redelivered trajectory is scored again: the
                                      ``samples`` view keeps the last score of each ``trajectory_id``)
metrics        flywheel.metrics       value of a ``Metrics`` record (``name``, ``value``; the ``evals``
                                      view holds the ``eval/*`` records, ``metrics_wide`` one column
                                      per name)
alerts         flywheel.alerts        drift-monitor alert (firing or resolved)
group_drops    flywheel.group_drops   group the trainer dropped
control        flywheel.control       operator command or scheduler announcement
rejected       (any of the above)     record that does not decode (``error`` says why)
=============  =====================  ================================================================

**Delivery.** No consumer group (joining one takes about 23 s on the embedded broker): the reader
``assign()``\\ s every partition and seeks to the offsets stored in the database's ``ingest_offsets``.
Each ``getmany`` batch is one DuckDB transaction holding its rows *and* the partitions' next offsets, so
a crash loses nothing and duplicates nothing; the primary keys make a re-read a no-op besides
(``INSERT ... ON CONFLICT DO NOTHING``). A run without ``--follow`` stops once every partition is at least
at the end offset read at the start *and* has either given a record produced after the start (by its
Kafka timestamp: a live system's busy partitions) or nothing for ``quiet_s`` seconds: the embedded broker
reports the base offset of the last batch + 1 as the end offset (notes/tansu-broker.md), so the end
offset alone would stop short.

**A different log.** Coordinates identify a record only within one broker's log; a fresh embedded broker
(a second ``flywheel up`` in the same run directory) starts again at offset 0. The reader re-reads the
last record it stored on each partition and compares a digest of its timestamp, key and value with the
stored one; a mismatch raises :class:`LogChangedError` before anything of the new log is written.

Times are Unix seconds (``DOUBLE``) as in the records; ``kafka_time`` is the Kafka record timestamp.
Record fields added after a row was written are NULL in that row (a new column is added to an existing
database at open). TensorBoard scalars are not written (tensorboardX is not installed here).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import duckdb
import orjson
from aiokafka import ConsumerRecord, TopicPartition

from shared import topics
from shared.config import KafkaConfig
from shared.kafka import make_consumer
from shared.schemas import Alert, Control, DecodeError, GroupDropped, Metrics, Record, RewardEvent, Task, decode

log = logging.getLogger(__name__)

KAFKA_COLUMNS = (("kafka_topic", "VARCHAR"), ("kafka_partition", "INTEGER"), ("kafka_offset", "BIGINT"),
                 ("kafka_time", "DOUBLE"))
"""Columns of every table: where the record was read (the primary key) and its Kafka timestamp (seconds)."""
COST_KEYS = ("generated_tokens", "tool_rounds", "tool_seconds", "sandbox_seconds", "judge_calls", "verify_seconds")
"""``RewardEvent.cost`` keys stored as their own ``rewards`` columns (a missing key counts 0, as in the record)."""
MAX_PAYLOAD = 65536
"""Characters of a rejected record's value kept in ``rejected.payload``."""


@dataclass(frozen=True)
class TableSpec:
    """One record type's table: its topic, its columns beyond :data:`KAFKA_COLUMNS`, and how a decoded
    record becomes rows (one, or one per value for ``metrics``)."""

    name: str
    topic: str
    record: type[Record]
    columns: tuple[tuple[str, str], ...]
    rows: Callable[[Any], list[dict]]
    key: tuple[str, ...] = ()
    """Primary-key columns after the Kafka coordinates."""


def _given(rec: Record, name: str) -> Any:
    """``rec.<name>`` when the record carried the field, else None (a record older than the field, whose
    default would otherwise pass for a value)."""
    return getattr(rec, name, None) if name in rec.model_fields_set else None


def _task_rows(t: Task) -> list[dict]:
    return [{"task_id": t.task_id, "domain": t.domain, "split": t.split, "difficulty": t.difficulty,
             "samples_per_task": t.samples_per_task, "verifier_kind": t.verifier.kind, "max_turns": t.max_turns,
             "tools": t.tools, "pool": t.pool, "prompt": [m.model_dump() for m in t.prompt],
             "verifier": t.verifier.model_dump(mode="json"), "metadata": t.metadata}]


def _reward_rows(r: RewardEvent) -> list[dict]:
    row = r.model_dump(mode="json", by_alias=False, exclude={"schema_", "schema_version"})
    for name in ("event_time", "verifier_kind", "components", "gates"):  # newer fields: NULL when absent
        row[name] = _given(r, name)
    row.update({k: float(r.cost.get(k, 0.0)) for k in COST_KEYS})
    return [row]


def _metric_rows(m: Metrics) -> list[dict]:
    base = {"source": m.source, "step": m.step, "policy_version": m.policy_version,
            "domain": getattr(m, "domain", None), "time": m.time}
    return [base | {"name": k, "value": v} for k, v in m.values.items()]


def _dump_rows(rec: Record) -> list[dict]:
    return [rec.model_dump(mode="json", by_alias=False, exclude={"schema_", "schema_version"})]


def _alert_rows(a: Alert) -> list[dict]:
    row = _dump_rows(a)[0]
    row["window_size"] = row.pop("window")  # WINDOW is an SQL keyword
    return [row | {"key": a.key}]


TABLES: tuple[TableSpec, ...] = (
    TableSpec("tasks", topics.TASKS, Task, (
        ("task_id", "VARCHAR"), ("domain", "VARCHAR"), ("split", "VARCHAR"), ("difficulty", "DOUBLE"),
        ("samples_per_task", "INTEGER"), ("verifier_kind", "VARCHAR"), ("max_turns", "INTEGER"),
        ("tools", "VARCHAR[]"), ("pool", "VARCHAR"), ("prompt", "JSON"), ("verifier", "JSON"), ("metadata", "JSON")),
        _task_rows),
    TableSpec("rewards", topics.REWARDS, RewardEvent, (
        ("task_id", "VARCHAR"), ("group_id", "VARCHAR"), ("trajectory_id", "VARCHAR"), ("sample_index", "INTEGER"),
        ("group_size", "INTEGER"), ("domain", "VARCHAR"), ("difficulty", "DOUBLE"), ("purpose", "VARCHAR"),
        ("attempt", "INTEGER"), ("eval_round", "INTEGER"), ("reward", "DOUBLE"), ("passed", "BOOLEAN"),
        ("infra_error", "BOOLEAN"), ("misconfigured", "BOOLEAN"), ("reason", "VARCHAR"),
        ("completion_tokens", "INTEGER"), ("finish_reason", "VARCHAR"), ("policy_version", "INTEGER"),
        ("cost", "JSON"), *((k, "DOUBLE") for k in COST_KEYS), ("completion_hash", "VARCHAR"),
        ("surprisal", "DOUBLE"), ("hacks", "VARCHAR[]"), ("event_time", "DOUBLE"), ("verifier_kind", "VARCHAR"),
        ("components", "JSON"), ("gates", "VARCHAR[]")),
        _reward_rows),
    TableSpec("metrics", topics.METRICS, Metrics, (
        ("name", "VARCHAR"), ("value", "DOUBLE"), ("source", "VARCHAR"), ("step", "BIGINT"),
        ("policy_version", "BIGINT"), ("domain", "VARCHAR"), ("time", "DOUBLE")),
        _metric_rows, key=("name",)),
    TableSpec("alerts", topics.ALERTS, Alert, (
        ("key", "VARCHAR"), ("source", "VARCHAR"), ("domain", "VARCHAR"), ("signal", "VARCHAR"), ("status", "VARCHAR"),
        ("severity", "VARCHAR"), ("value", "DOUBLE"), ("threshold", "DOUBLE"), ("reference", "DOUBLE"),
        ("window_size", "INTEGER"), ("window_unit", "VARCHAR"), ("policy_version", "INTEGER"),
        ("message", "VARCHAR"), ("details", "JSON"), ("time", "DOUBLE")),
        _alert_rows),
    TableSpec("group_drops", topics.GROUP_DROPS, GroupDropped, (
        ("group_id", "VARCHAR"), ("reason", "VARCHAR"), ("policy_version", "INTEGER"),
        ("behaviour_version", "INTEGER"), ("samples", "INTEGER"), ("time", "DOUBLE")),
        _dump_rows),
    TableSpec("control", topics.CONTROL, Control, (
        ("command", "VARCHAR"), ("domain", "VARCHAR"), ("signal", "VARCHAR"), ("threshold", "JSON"),
        ("trainable", "BOOLEAN"), ("drop_groups", "VARCHAR[]"), ("reason", "VARCHAR"), ("origin", "VARCHAR"),
        ("control_id", "VARCHAR"), ("time", "DOUBLE")),
        _dump_rows),
)
"""The tables :func:`ingest` fills, one per topic."""

REJECTED = TableSpec("rejected", "", Record, (("error", "VARCHAR"), ("payload", "VARCHAR")), lambda r: [])
"""Records that do not decode as their topic's type (or hold a value the table cannot take)."""

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


@dataclass(frozen=True)
class Question:
    """An operator's question and the SQL that answers it (docs/observability.md, "Analytics")."""

    title: str
    sql: str


QUESTIONS: dict[str, Question] = {
    "pass_rate_by_version": Question(
        "Per-domain pass rate by policy version (training samples, by the version that generated them)",
        """SELECT domain, policy_version, count(*) AS samples, round(avg(passed::INT), 3) AS pass_rate,
       round(avg(reward), 3) AS mean_reward
FROM samples WHERE purpose = 'train' AND NOT infra_error
GROUP BY domain, policy_version ORDER BY domain, policy_version"""),
    "reward_histogram": Question(
        "Reward histogram per domain (bins of 0.1)",
        """SELECT domain, floor(reward * 10) / 10 AS bin, count(*) AS samples,
       round(count(*) / sum(count(*)) OVER (PARTITION BY domain), 3) AS share
FROM samples WHERE NOT infra_error
GROUP BY domain, bin ORDER BY domain, bin"""),
    "length_inflation": Question(
        "Length inflation: mean completion tokens by policy version per domain, and the change since the first",
        """SELECT domain, policy_version, count(*) AS samples, round(avg(completion_tokens), 2) AS mean_tokens,
       round(avg(completion_tokens) - first_value(avg(completion_tokens))
             OVER (PARTITION BY domain ORDER BY policy_version), 2) AS vs_first,
       round(avg((finish_reason = 'length')::INT), 3) AS truncated
FROM samples WHERE purpose = 'train'
GROUP BY domain, policy_version ORDER BY domain, policy_version"""),
    "hack_rate": Question(
        "Hack rate per domain (samples a reward-hacking detector flagged) and which detectors fired",
        """SELECT domain, count(*) AS samples, count(*) FILTER (WHERE len(hacks) > 0) AS flagged,
       round(avg((len(hacks) > 0)::INT), 4) AS hack_rate,
       count(*) FILTER (WHERE len(hacks) > 0 AND passed) AS flagged_and_passed,
       list_sort(list_distinct(flatten(list(hacks)))) AS detectors
FROM samples GROUP BY domain ORDER BY domain"""),
    "cost_per_domain": Question(
        "Cost per domain and split: generated tokens, sandbox seconds, judge calls (RewardEvent.cost)",
        """SELECT domain, purpose, count(*) AS samples, sum(generated_tokens)::BIGINT AS generated_tokens,
       round(sum(sandbox_seconds), 2) AS sandbox_seconds, sum(judge_calls)::BIGINT AS judge_calls,
       round(sum(verify_seconds), 2) AS verify_seconds,
       round(sum(generated_tokens) / nullif(count(*) FILTER (WHERE passed), 0), 1) AS tokens_per_pass
FROM samples GROUP BY domain, purpose ORDER BY domain, purpose"""),
    "heldout_accuracy": Question(
        "Held-out greedy accuracy per eval round and domain (the eval records on flywheel.metrics)",
        """SELECT eval_round, policy_version, coalesce(domain, '(all)') AS domain, n, round(accuracy, 3) AS accuracy
FROM evals QUALIFY row_number() OVER (PARTITION BY eval_round, domain ORDER BY kafka_offset DESC) = 1
ORDER BY eval_round, domain NULLS FIRST"""),
}
"""The operator questions of docs/observability.md (the first five), plus held-out accuracy; ``flywheel analytics query NAME``
runs one by name."""


# ---------------------------------------------------------------- records to rows (pure)


class LogChangedError(RuntimeError):
    """The record at a stored position is not the one ingested before: the topic's log was replaced (a new
    embedded broker); ingesting it into this database would mix two logs under the same coordinates."""


def digest(msg: ConsumerRecord) -> str:
    """16 hex digits of BLAKE2b over a record's timestamp (ms), key and value: what identifies the record
    at a position when the log is re-read."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(msg.timestamp).encode() + b"\0" + (msg.key or b"") + b"\0" + (msg.value or b""))
    return h.hexdigest()


def rows_for(msgs: Iterable[ConsumerRecord], specs: Mapping[str, TableSpec]) -> dict[str, list[dict]]:
    """The rows of a batch of records, by table name; ``specs`` maps a topic to its table.

    A record that does not decode as its table's type, or whose rows cannot be built, becomes a
    ``rejected`` row (``error``: the decoder's reason) and the batch goes on.
    """
    out: dict[str, list[dict]] = defaultdict(list)
    for m in msgs:
        spec = specs[m.topic]
        coords = {"kafka_topic": m.topic, "kafka_partition": m.partition, "kafka_offset": m.offset,
                  "kafka_time": m.timestamp / 1000.0 if m.timestamp is not None else None}
        try:
            rows = spec.rows(decode(m.value, spec.record))
        except DecodeError as e:
            error = e.reason
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # a value the row builder cannot take
            error = f"row: {type(e).__name__}: {e}"
        else:
            out[spec.name].extend(coords | r for r in rows)
            continue
        payload = (m.value or b"")[:MAX_PAYLOAD].decode("utf-8", errors="replace")
        out[REJECTED.name].append(coords | {"error": error, "payload": payload})
    return out


# ---------------------------------------------------------------- the database


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


# ---------------------------------------------------------------- the reader


@dataclass
class IngestReport:
    """What one :func:`ingest` did."""

    records: int = 0
    """Kafka records read (re-reads of stored ones included)."""
    added: dict[str, int] = field(default_factory=dict)
    """Rows inserted per table (``rejected`` included)."""
    batches: int = 0
    """Transactions committed (one per ``getmany`` batch)."""
    seconds: float = 0.0
    """Wall time of the ingest."""


def specs_for(topic_names: Mapping[str, str] | None = None) -> dict[str, TableSpec]:
    """``topic → TableSpec`` for :data:`TABLES`, with the topic of a table replaced where ``topic_names`` maps
    its name to another (tests, or a second system on one broker)."""
    specs = (replace(s, topic=(topic_names or {}).get(s.name, s.topic)) for s in TABLES)
    return {s.topic: s for s in specs}


async def _assign(consumer, store: Store, specs: Mapping[str, TableSpec]) -> dict[TopicPartition, tuple[int, str]]:
    """Assign every partition of the topics that exist and seek each to the record before its stored offset
    (re-read to check it is the same, :func:`check_continuity`) or to 0; returns the checks owed."""
    existing = await consumer.topics()
    tps = [TopicPartition(t, p) for t in specs if t in existing for p in sorted(consumer.partitions_for_topic(t) or ())]
    consumer.assign(tps)
    stored, owed = store.offsets(), {}
    for tp in tps:
        n, d = stored.get((tp.topic, tp.partition), (0, ""))
        consumer.seek(tp, max(n - 1, 0))
        if n > 0:
            owed[tp] = (n - 1, d)
    missing = sorted(set(specs) - set(existing))
    if missing:
        log.info("not on the broker (yet): %s", ", ".join(missing))
    return owed


def check_continuity(owed: dict[TopicPartition, tuple[int, str]], batch: Mapping[TopicPartition, list]) -> None:
    """Settle the checks ``owed`` (partition → offset and digest of the last record stored) that ``batch``
    answers: its first record on such a partition must be that record. Removes each settled check.

    Raises:
        LogChangedError: a different record (or offset) is there.
    """
    for tp, msgs in batch.items():
        if tp in owed and msgs:
            offset, want = owed.pop(tp)
            first = msgs[0]
            if first.offset != offset or digest(first) != want:
                raise LogChangedError(
                    f"{tp.topic}[{tp.partition}]: the record at offset {offset} is not the one ingested before "
                    f"(found offset {first.offset}): the broker's log was replaced (a new embedded broker?). "
                    "Ingest into a new database (--db).")


async def ingest(store: Store, cfg: KafkaConfig, *, follow: bool = False, stop: asyncio.Event | None = None,
                 quiet_s: float = 1.5, batch_records: int = 5000, follow_pause_s: float = 2.0,
                 topic_names: Mapping[str, str] | None = None,
                 on_batch: Callable[[IngestReport], None] | None = None) -> IngestReport:
    """Read the topics of :data:`TABLES` from the stored offsets into ``store``, one transaction per batch of
    at most ``batch_records`` records.

    Without ``follow`` it returns once every partition is at least at its end offset (read at the start) and
    has either given a record produced after the start or nothing for ``quiet_s`` seconds (:class:`_EndOfLog`);
    with ``follow`` it goes on until ``stop`` is
    set, and once caught up (a batch smaller than ``batch_records``) it closes the file and waits
    ``follow_pause_s`` seconds before the next batch, so ``flywheel analytics query`` can open it meanwhile
    (DuckDB lets one process hold a file). ``on_batch`` is called after each committed batch with the
    running report.

    Raises:
        LogChangedError: a stored position holds a different record (see the module docstring).
        aiokafka.errors.KafkaError: the broker cannot be reached.
    """
    specs, stop = specs_for(topic_names), stop or asyncio.Event()
    report, t0 = IngestReport(), time.monotonic()
    consumer = make_consumer(cfg, group_id=None, client_id="flywheel-analytics")
    try:
        await consumer.start()
        owed = await _assign(consumer, store, specs)
        end = _EndOfLog(await consumer.end_offsets(list(consumer.assignment())) if consumer.assignment() else {},
                        quiet_s)
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200, max_records=batch_records)
            batch = {tp: msgs for tp, msgs in batch.items() if msgs}
            if batch:
                n = _write_batch(store, specs, owed, batch, report)
                end.saw(batch)
                if on_batch is not None:
                    on_batch(report)
                if follow and n < batch_records:  # caught up: give the file to readers for a while
                    store.refresh_views()
                    store.close()
                    await _pause(stop, follow_pause_s)
            if not follow and await end.reached(consumer):
                break
        if not follow:
            await _settle_owed(consumer, owed)
        store.refresh_views()
    finally:
        await consumer.stop()
    report.seconds = time.monotonic() - t0
    return report


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less when ``stop`` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def _write_batch(store: Store, specs, owed, batch: Mapping[TopicPartition, list], report: IngestReport) -> int:
    """Check, turn into rows and store one batch (:meth:`Store.write`); returns its records."""
    check_continuity(owed, batch)
    msgs = [m for ms in batch.values() for m in ms]
    positions = {(tp.topic, tp.partition): (ms[-1].offset + 1, digest(ms[-1])) for tp, ms in batch.items()}
    for name, n in store.write(rows_for(msgs, specs), positions).items():
        report.added[name] = report.added.get(name, 0) + n
    report.records += len(msgs)
    report.batches += 1
    return len(msgs)


class _EndOfLog:
    """When a run without ``--follow`` has read every partition to where it ended at the start.

    A partition is done when its position is at least the end offset read at the start (a lower bound on
    the embedded broker) and either a record produced after the start has come (its Kafka timestamp is
    later: a live system's busy partitions) or nothing has come from it for ``quiet_s`` seconds.
    """

    def __init__(self, ends: Mapping[TopicPartition, int], quiet_s: float) -> None:
        self.ends, self.quiet_s = dict(ends), quiet_s
        self.start_ms = int(time.time() * 1000)
        now = time.monotonic()
        self.last_seen = {tp: now for tp in self.ends}
        self.passed: set[TopicPartition] = set()

    def saw(self, batch: Mapping[TopicPartition, list]) -> None:
        """Note a batch's records."""
        now = time.monotonic()
        for tp, msgs in batch.items():
            self.last_seen[tp] = now
            if (msgs[-1].timestamp or 0) >= self.start_ms:
                self.passed.add(tp)

    async def reached(self, consumer) -> bool:
        """Every partition done."""
        now = time.monotonic()
        for tp, end in self.ends.items():
            if await consumer.position(tp) < end:
                return False
            if tp not in self.passed and now - self.last_seen[tp] < self.quiet_s:
                return False
        return True


async def _settle_owed(consumer, owed: Mapping[TopicPartition, tuple[int, str]]) -> None:
    """After a full read: a check still owed means the partition no longer holds the last record stored.

    Raises:
        LogChangedError: such a partition.
    """
    for tp, (offset, _) in owed.items():
        if await consumer.position(tp) <= offset:
            raise LogChangedError(f"{tp.topic}[{tp.partition}] ends before offset {offset}, which this database "
                                  "ingested: the broker's log was replaced (a new embedded broker?). "
                                  "Ingest into a new database (--db).")


# ---------------------------------------------------------------- queries


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


def query(db: str | Path, sql: str, timeout_s: float = 10.0) -> tuple[list[str], list[tuple]]:
    """Run ``sql`` (or the :data:`QUESTIONS` entry of that name) on the database read-only; returns the column
    names and the rows. Retries for ``timeout_s`` seconds while an ingest holds the file.

    Raises:
        FileNotFoundError: no database at ``db``.
        duckdb.Error: the SQL is wrong (the message says where), or the file stays locked.
    """
    if not Path(db).exists():
        raise FileNotFoundError(f"no analytics database at {db} (run `flywheel analytics` first)")
    sql = QUESTIONS[sql].sql if sql in QUESTIONS else sql
    con = connect(db, read_only=True, lock_wait_s=timeout_s)
    try:
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    finally:
        con.close()
