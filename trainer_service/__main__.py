"""``python -m trainer_service``: run the trainer with the system config (YAML + environment)."""

import asyncio

from shared.config import load_config
from trainer_service.main import run

if __name__ == "__main__":
    asyncio.run(run(load_config()))
