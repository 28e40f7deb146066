"""``python -m verifier_service``: run the verifier with the system config (file + environment)."""

import asyncio

from shared.config import load_config
from verifier_service.main import run

if __name__ == "__main__":
    asyncio.run(run(load_config()))
