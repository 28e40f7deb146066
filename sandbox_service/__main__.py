"""``python -m sandbox_service``: run the sandbox HTTP service with its own settings (``SandboxSettings``: its section and the
shared ones, from the YAML file named by ``FLYWHEEL_CONFIG`` and the environment)."""

import asyncio

from sandbox_service.config import SandboxSettings
from sandbox_service.main import run

if __name__ == "__main__":
    asyncio.run(run(SandboxSettings.load()))
