"""Entry point of the sandbox service: logging, isolation probe, then the HTTP server until SIGTERM/SIGINT."""

from __future__ import annotations

import uvicorn

from sandbox_service.api import create_app
from sandbox_service.executor import probe_network_isolation
from shared.config import FlywheelConfig
from shared.telemetry import setup_logging


async def run(config: FlywheelConfig) -> None:
    """Serve the sandbox API on ``config.sandbox.host:port`` until the process is told to stop.

    Raises:
        RuntimeError: ``config.sandbox.require_network_isolation`` is set and ``unshare --net`` does not work.
        OSError: the port cannot be bound.
    """
    log = setup_logging("sandbox", config.run.log_level, config.run.path("logs"))
    cfg = config.sandbox
    isolated = await probe_network_isolation(cfg)
    if not isolated:
        if cfg.require_network_isolation:
            raise RuntimeError("sandbox: network isolation required but `unshare --net` does not work here "
                               "(needs util-linux and root or CAP_SYS_ADMIN)")
        log.warning("sandbox runs DEGRADED: no network isolation")
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning"))
    log.info("sandbox listening on %s:%d", cfg.host, cfg.port)
    await server.serve()
    log.info("sandbox stopped")
