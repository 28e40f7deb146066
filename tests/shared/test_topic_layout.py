"""Topics exist before anyone subscribes, and their partition counts are checked at start-up.

A client that touches a topic nobody created (a consumer subscribing, a producer sending) makes the embedded
broker auto-create it with its own default of 4 partitions, whatever ``kafka.partitions`` says: in one of two
embedded runs flywheel.trajectories had 4 partitions instead of 8, capping verifier replicas at 4.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from shared import topics
from shared.config import KafkaConfig
from shared.kafka import TopicLayoutError, ensure_topics, make_admin, make_producer

pytestmark = pytest.mark.kafka


async def _partitions(cfg: KafkaConfig, names: list[str]) -> dict[str, int]:
    admin = make_admin(cfg)
    await admin.start()
    try:
        return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(names)}
    finally:
        await admin.close()


async def test_an_auto_created_topic_is_reported_short_and_refused_when_strict(kafka_cfg, caplog):
    cfg = KafkaConfig(bootstrap_servers=kafka_cfg.bootstrap_servers, partitions=8)
    pool = f"{topics.ROLLOUT_REQUESTS}.t{uuid.uuid4().hex[:8]}"  # a pool's request topic: partitioned (8)
    p = make_producer(cfg)
    await p.start()
    try:
        await (await p.send(pool, b"x"))  # before anyone created it: the broker auto-creates it
    finally:
        await p.stop()
    assert (await _partitions(cfg, [pool]))[pool] < 8
    with caplog.at_level(logging.ERROR, logger="shared.kafka"):
        short = await ensure_topics(cfg, [pool])
    have = short[pool][0]
    assert short == {pool: (have, 8)} and f"{pool} has {have}, wants 8" in caplog.text
    with pytest.raises(TopicLayoutError, match="wants 8") as e:
        await ensure_topics(cfg, [pool], strict=True)
    assert e.value.short == short


async def test_topics_created_first_have_their_configured_counts(kafka_cfg):
    cfg = KafkaConfig(bootstrap_servers=kafka_cfg.bootstrap_servers, partitions=8)
    pool = f"{topics.ROLLOUT_REQUESTS}.t{uuid.uuid4().hex[:8]}"
    assert await ensure_topics(cfg, [pool], strict=True) == {}
    assert await _partitions(cfg, [pool]) == {pool: 8}
