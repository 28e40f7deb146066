"""``flywheel analytics``: the topics into DuckDB, incrementally and idempotently.

    flywheel analytics [--run-dir D] [--bootstrap HOST:PORT] [--db PATH] [--follow]
    flywheel analytics query "SELECT domain, count(*) FROM rewards GROUP BY ALL" [--json]

One table per record type, with typed columns (:data:`~flywheel.analytics.tables.TABLES`), each keyed by the record's Kafka
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
stored one; a mismatch raises :class:`~flywheel.analytics.ingest.LogChangedError` before anything of the new log is written.

Times are Unix seconds (``DOUBLE``) as in the records; ``kafka_time`` is the Kafka record timestamp.
Record fields added after a row was written are NULL in that row (a new column is added to an existing
database at open). TensorBoard scalars are not written (tensorboardX is not installed here).

The package: :mod:`~flywheel.analytics.tables` (the tables and how a record becomes rows),
:mod:`~flywheel.analytics.store` (the DuckDB file), :mod:`~flywheel.analytics.ingest` (the reader) and
:mod:`~flywheel.analytics.queries` (the operators' questions, and SQL on the file).
"""
