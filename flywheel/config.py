"""The root configuration of a Flywheel system: every section, checked together.

:class:`FlywheelConfig` inherits from each service's settings (``<service>/config.py``), so it is a
``TrainerSettings``, a ``RolloutSettings`` and so on at once, and adds the driver's own ``tasks``
section. Unlike a service's settings it rejects unknown sections (a section itself names the new place
of a key that moved out of it, for example ``trainer.max_steps`` → ``budget.max_steps``, in the root
config and in the service's own settings alike). The CLI and the launcher load it; each service process loads only its own settings (``python -m trainer_service`` reads
``TrainerSettings``). Sources and precedence: see :mod:`shared.config`.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic_settings import SettingsConfigDict

from flywheel.tasks import TaskSourceConfig
from rollout_service.config import RolloutSettings
from sandbox_service.config import SandboxSettings
from scheduler_service.config import SchedulerSettings
from trainer_service.config import TrainerSettings
from verifier_service.config import VerifierSettings


class FlywheelConfig(SchedulerSettings, RolloutSettings, VerifierSettings, TrainerSettings, SandboxSettings):
    """Root config: every service's section plus the shared ones and ``tasks``."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True
    )

    tasks: TaskSourceConfig = TaskSourceConfig()
    """What ``flywheel run`` submits (read by the CLI only)."""


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> FlywheelConfig:
    """Build the root config from a YAML file, the environment and ``overrides`` (:meth:`Settings.load`).

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ValueError: the file's top level is not a mapping, or the environment sets a field and its sub-field.
        pydantic.ValidationError: a field is unknown, moved or out of bounds (the message names it).
    """
    return FlywheelConfig.load(path, **overrides)
