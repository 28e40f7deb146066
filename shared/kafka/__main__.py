"""``python -m shared.kafka``: create every topic of the system and check the partition counts (compose's
one-shot ``kafka-topics``, run before any service)."""

from __future__ import annotations

import asyncio
import logging

from shared import topics
from shared.kafka.clients import TopicLayoutError, ensure_topics
from shared.telemetry import setup_logging

log = logging.getLogger("shared.kafka")


def _main() -> int:
    """``python -m shared.kafka``: create every topic of the system (``$FLYWHEEL_CONFIG`` and the environment's
    ``kafka`` section) and check their partition counts; exit 1 naming the short ones (compose's one-shot
    ``kafka-topics``, run before any service)."""
    from shared.config import Settings

    setup_logging("kafka-topics")
    cfg = Settings.load().kafka
    try:
        asyncio.run(ensure_topics(cfg, strict=True))
    except TopicLayoutError as e:
        log.error("%s", e)
        return 1
    log.info("%d topics on %s with their partition counts", len(topics.ALL), cfg.bootstrap_servers)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
