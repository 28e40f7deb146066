"""The root configuration of a Flywheel system: every section, checked together.

:class:`FlywheelConfig` inherits from each service's settings (``<service>/config.py``), so it is a
``TrainerSettings``, a ``RolloutSettings`` and so on at once, and adds the driver's own ``tasks``
section. Unlike a service's settings it rejects unknown sections, and it names the new place of a key
that moved (for example ``trainer.max_steps`` → ``budget.max_steps``). The CLI and the launcher load
it; each service process loads only its own settings (``python -m trainer_service`` reads
``TrainerSettings``). Sources and precedence: see :mod:`shared.config`.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from flywheel.tasks import TaskSourceConfig
from rollout_service.config import RolloutSettings
from sandbox_service.config import SandboxSettings
from scheduler_service.config import SchedulerSettings
from shared.config import KafkaConfig, ModelConfig, RunConfig  # noqa: F401  (re-exported for callers)
from trainer_service.config import TrainerSettings
from verifier_service.config import VerifierSettings

MOVED: dict[tuple[str, str], str] = {
    ("trainer", "batch_groups"): "budget.batch_groups",
    ("trainer", "max_staleness"): "budget.max_staleness",
    ("trainer", "max_steps"): "budget.max_steps",
    ("scheduler", "oversample"): "budget.oversample",
    ("scheduler", "resample_unsolved"): "budget.resample_unsolved",
    ("trainer", "weight_transport"): "weights.transport",
    ("trainer", "broadcast_host"): "weights.broadcast_host",
    ("trainer", "broadcast_port"): "weights.broadcast_port",
    ("trainer", "broadcast_backend"): "weights.broadcast_backend",
    ("trainer", "broadcast_timeout_s"): "weights.broadcast_timeout_s",
}
"""Keys that moved to a shared section, and where they live now."""


class FlywheelConfig(SchedulerSettings, RolloutSettings, VerifierSettings, TrainerSettings, SandboxSettings):
    """Root config: every service's section plus the shared ones and ``tasks``."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True
    )

    tasks: TaskSourceConfig = TaskSourceConfig()
    """What ``flywheel run`` submits (read by the CLI only)."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for (section, key), to in MOVED.items():
                sec = data.get(section)
                if isinstance(sec, dict) and key in sec:
                    raise ValueError(f"{section}.{key} has moved to {to} "
                                     f"(env FLYWHEEL_{to.upper().replace('.', '__')})")
        return data


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> FlywheelConfig:
    """Build the root config from a YAML file, the environment and ``overrides`` (:meth:`Settings.load`).

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ValueError: the file's top level is not a mapping.
        pydantic.ValidationError: a field is unknown, moved or out of bounds (the message names it).
    """
    return FlywheelConfig.load(path, **overrides)
