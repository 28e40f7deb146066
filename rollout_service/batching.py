"""Request batching of the rollout service: take rollout requests from Kafka with backpressure.

A batch is taken one record at a time until it holds ``rollout.max_batch_samples`` samples (Σ ``n``)
or ``rollout.max_batch_requests`` requests; a request that would overflow the samples is left in Kafka
(the consumer seeks back to it) for the next batch or another replica of the group. A single request
larger than the limit still runs alone. Malformed records are dead-lettered, and committed with the
batch like the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from shared import kafka
from shared.schemas import RolloutRequest

Headers = Sequence[tuple[str, bytes]]
"""A Kafka record's headers (the trace context of the request, read by ``shared.telemetry.extract_context``)."""


@dataclass
class Batch:
    """What one :func:`take_batch` took.

    ``records`` are the raw records per partition (committed with :func:`shared.kafka.commit_batch` once
    the batch is published, dead-lettered ones included); ``requests[i]`` came with ``headers[i]``.
    """

    records: dict[TopicPartition, list[ConsumerRecord]] = field(default_factory=dict)
    requests: list[RolloutRequest] = field(default_factory=list)
    headers: list[Headers] = field(default_factory=list)

    @property
    def samples(self) -> int:
        """Σ ``n`` over the requests."""
        return sum(r.n for r in self.requests)

    @property
    def min_policy_version(self) -> int:
        """The policy version the engine must hold before the batch runs: the largest
        ``min_policy_version`` of its requests (0 when empty)."""
        return max((r.min_policy_version for r in self.requests), default=0)


async def take_batch(consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, max_requests: int,
                     max_samples: int) -> Batch:
    """Take requests one record at a time until ``max_samples`` samples or ``max_requests`` requests.

    Waits at most 200 ms for the first record, then only takes records already fetched (a peek with
    no wait); returns an empty batch when none arrived. A request that does not fit the samples left is
    not taken: ``consumer`` seeks back to it. Malformed records are dead-lettered through ``producer``
    (and are in ``records``, to be committed).
    """
    batch = Batch()
    while batch.samples < max_samples and len(batch.requests) < max_requests:
        got = await consumer.getmany(timeout_ms=0 if batch.requests else 200, max_records=1)
        if not got:
            break
        for tp, msgs in got.items():
            for msg in msgs:
                r = await kafka.decode_or_dead_letter(producer, msg, RolloutRequest, "rollout")
                if r is not None and batch.requests and batch.samples + r.n > max_samples:
                    consumer.seek(tp, msg.offset)  # does not fit: leave it for the next batch
                    return batch
                batch.records.setdefault(tp, []).append(msg)
                if r is not None:
                    batch.requests.append(r)
                    batch.headers.append(msg.headers)
    return batch
