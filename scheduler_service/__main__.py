"""``python -m scheduler_service``: load the config, run the scheduler."""

import asyncio

from shared.config import load_config

from scheduler_service.main import run

if __name__ == "__main__":
    asyncio.run(run(load_config()))
