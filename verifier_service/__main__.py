"""``python -m verifier_service``: run the verifier with its own settings (``VerifierSettings``: its section and the
shared ones, from the YAML file named by ``FLYWHEEL_CONFIG`` and the environment)."""

import asyncio

from verifier_service.config import VerifierSettings
from verifier_service.main import run

if __name__ == "__main__":
    asyncio.run(run(VerifierSettings.load()))
