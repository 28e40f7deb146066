"""``python -m sandbox_service``: run the sandbox HTTP service with the system config."""

import asyncio

from sandbox_service.main import run
from shared.config import load_config

if __name__ == "__main__":
    asyncio.run(run(load_config()))
