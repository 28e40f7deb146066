"""The reader of ``flywheel analytics``: the topics into a :class:`~flywheel.analytics.store.Store` from
the stored offsets, one transaction per batch (:func:`ingest`), checking that a stored position still holds
the record ingested before (:class:`LogChangedError` otherwise), and when a run without ``--follow`` has
read every partition to its end (:class:`_EndOfLog`)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from aiokafka import ConsumerRecord, TopicPartition

from flywheel.analytics.store import Store
from flywheel.analytics.tables import TABLES, TableSpec, rows_for
from shared.config import KafkaConfig
from shared.kafka import make_consumer

log = logging.getLogger("flywheel.analytics")


class LogChangedError(RuntimeError):
    """The record at a stored position is not the one ingested before: the topic's log was replaced (a new
    embedded broker); ingesting it into this database would mix two logs under the same coordinates."""


def digest(msg: ConsumerRecord) -> str:
    """16 hex digits of BLAKE2b over a record's timestamp (ms), key and value: what identifies the record
    at a position when the log is re-read."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(msg.timestamp).encode() + b"\0" + (msg.key or b"") + b"\0" + (msg.value or b""))
    return h.hexdigest()


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
        LogChangedError: a stored position holds a different record (see :mod:`flywheel.analytics`).
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
