"""``python -m scheduler_service``: run the scheduler with its own settings (``SchedulerSettings``: its section and the
shared ones, from the YAML file named by ``FLYWHEEL_CONFIG`` and the environment)."""

import asyncio

from scheduler_service.config import SchedulerSettings
from scheduler_service.main import run

if __name__ == "__main__":
    asyncio.run(run(SchedulerSettings.load()))
