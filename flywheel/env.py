"""The environment API for users' code: ``from flywheel.env import Environment, Rubric``.

The same objects as :mod:`shared.envs` (where the services load them from); importing this module loads nothing
else of the driver. Guides: docs/guides/environments.md, docs/guides/http-environments.md.
"""

from shared.envs import (  # noqa: F401 - the public names
    ENTRY_POINT_GROUP,
    REWARD_ARGS,
    DatasetError,
    Environment,
    EnvironmentLoadError,
    EnvironmentRef,
    OpenEnvError,
    RewardError,
    Rubric,
    RubricScore,
    load_environment,
    load_rows,
    openenv_environment,
)

__all__ = ["ENTRY_POINT_GROUP", "REWARD_ARGS", "DatasetError", "Environment", "EnvironmentLoadError",
           "EnvironmentRef", "OpenEnvError", "RewardError", "Rubric", "RubricScore", "load_environment", "load_rows",
           "openenv_environment"]
