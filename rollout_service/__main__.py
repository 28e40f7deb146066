"""``python -m rollout_service``: run the rollout service with the system config (YAML + environment)."""

import asyncio

from rollout_service.main import run
from shared.config import load_config

if __name__ == "__main__":
    asyncio.run(run(load_config()))
