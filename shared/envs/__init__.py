"""Environments users bring: the API their code imports (as :mod:`flywheel.env`), loading by reference, datasets.

It lives in ``shared`` because the verifier (its rewards) and the rollout (its tools and multi-turn hooks) load users'
environments themselves, and the services import nothing from the driver; :mod:`flywheel.env` is its public
name, a re-export that loads nothing else of the driver.
"""

from shared.envs.api import REWARD_ARGS, Environment, RewardError, Rubric, RubricScore
from shared.envs.datasets import DatasetError, load_rows, normalise_row
from shared.envs.http_env import OpenEnvError, openenv_environment
from shared.envs.loading import (
    ENTRY_POINT_GROUP,
    EnvironmentLoadError,
    EnvironmentRef,
    cached_environment,
    load_environment,
)

__all__ = ["ENTRY_POINT_GROUP", "REWARD_ARGS", "DatasetError", "Environment", "EnvironmentLoadError",
           "EnvironmentRef", "OpenEnvError", "RewardError", "Rubric", "RubricScore", "cached_environment",
           "load_environment", "load_rows", "normalise_row", "openenv_environment"]
