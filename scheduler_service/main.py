"""Scheduler process: registry + REST API + sampler in one event loop."""

from __future__ import annotations

import os

import uvicorn

from scheduler_service.api import create_app
from scheduler_service.config import SchedulerSettings
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared.telemetry import flush_tracing, setup_logging, setup_tracing


async def run(config: SchedulerSettings) -> None:
    """Serve the scheduler until SIGTERM/SIGINT (uvicorn handles them and runs the lifespan shutdown).

    Raises:
        ValueError: ``scheduler.database_url`` is not a ``sqlite:///`` URL.
        aiokafka.errors.KafkaError: the broker cannot be reached at start-up.
    """
    os.umask(0o077)  # the registry, logs and token file are private, also where no launcher set it (compose)
    log = setup_logging("scheduler", config.run.log_level, config.run.path("logs"))
    setup_tracing("scheduler", config.telemetry, config.run)
    registry = Registry.from_url(config.scheduler.database_url, config.run)
    log.info("registry at %s", registry.path)
    try:
        app = create_app(config, SchedulerState(config, registry))
        sc = config.scheduler
        server = uvicorn.Server(uvicorn.Config(app, host=sc.host, port=sc.port, log_level="warning"))
        await server.serve()
    finally:
        registry.close()
        flush_tracing()
