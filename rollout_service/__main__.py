"""``python -m rollout_service``: run the rollout service with its own settings (``RolloutSettings``: its section and the
shared ones, from the YAML file named by ``FLYWHEEL_CONFIG`` and the environment)."""

import asyncio

from rollout_service.config import RolloutSettings
from rollout_service.main import run

if __name__ == "__main__":
    asyncio.run(run(RolloutSettings.load()))
