"""``python -m trainer_service``: run the trainer with its own settings (``TrainerSettings``: its section and the
shared ones, from the YAML file named by ``FLYWHEEL_CONFIG`` and the environment)."""

import asyncio

from trainer_service.config import TrainerSettings
from trainer_service.main import run

if __name__ == "__main__":
    asyncio.run(run(TrainerSettings.load()))
