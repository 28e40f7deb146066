"""The environment API for users' code: ``from flywheel.env import Environment, Rubric``.

The same objects as :mod:`shared.envs` (where the services load them from); importing this module loads nothing
else of the driver. Guide: docs/guides/environments.md.
"""

from shared.envs import (  # noqa: F401 - the public names
    ENTRY_POINT_GROUP,
    REWARD_ARGS,
    DatasetError,
    Environment,
    EnvironmentLoadError,
    EnvironmentRef,
    RewardError,
    Rubric,
    RubricScore,
    load_environment,
    load_rows,
)

__all__ = ["ENTRY_POINT_GROUP", "REWARD_ARGS", "DatasetError", "Environment", "EnvironmentLoadError",
           "EnvironmentRef", "RewardError", "Rubric", "RubricScore", "load_environment", "load_rows"]
