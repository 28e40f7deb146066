"""The analytics tables, one per record type (:data:`TABLES`), and how a batch of Kafka records becomes their
rows (:func:`rows_for`; a record that does not decode becomes a :data:`REJECTED` row). Pure: no database,
no broker."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from aiokafka import ConsumerRecord

from shared import topics
from shared.schemas import Alert, Control, DecodeError, GroupDropped, Metrics, Record, RewardEvent, Task, decode


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
    for name in ("event_time", "verifier_kind", "components", "gates", "metrics"):  # newer fields: NULL when absent
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
        ("components", "JSON"), ("gates", "VARCHAR[]"), ("metrics", "JSON")),
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
