"""Entry point of the sandbox service: logging, isolation probe and worker pool, then HTTP until SIGTERM/SIGINT."""

from __future__ import annotations

import uvicorn

from sandbox_service.api import check_isolation, create_app
from sandbox_service.isolation import probe
from sandbox_service.config import SandboxSettings
from shared.auth import server_token
from shared.telemetry import flush_tracing, setup_logging, setup_tracing


async def run(config: SandboxSettings) -> None:
    """Serve the sandbox API on ``config.sandbox.host:port`` until the process is told to stop.

    Raises:
        RuntimeError: an isolation layer is missing and ``sandbox.allow_degraded`` is off (the message
            names each layer and why), or no worker started.
        OSError: the port cannot be bound.
        shared.auth.TokenError: the token file cannot be read or written.
    """
    log = setup_logging("sandbox", config.run.log_level, config.run.path("logs"))
    setup_tracing("sandbox", config.telemetry, config.run)  # before create_app, whose own call then keeps it
    cfg = config.sandbox
    caps = probe()
    check_isolation(cfg, caps)  # refuse before binding the port
    app = create_app(cfg, caps, auth_token=server_token(config.auth, config.run))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning"))
    log.info("sandbox listening on %s:%d", cfg.host, cfg.port)
    try:
        await server.serve()
    finally:
        flush_tracing()
    log.info("sandbox stopped")
