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
from typing import Any, Literal

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from flywheel.tasks import TaskSourceConfig
from rollout_service.config import RolloutSettings
from sandbox_service.config import SandboxSettings
from scheduler_service.config import SchedulerSettings
from trainer_service.config import SftConfig, TrainerSettings
from verifier_service.config import VerifierSettings


class FlywheelConfig(SchedulerSettings, RolloutSettings, VerifierSettings, TrainerSettings, SandboxSettings):
    """Root config: every service's section plus the shared ones and ``tasks``."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True
    )

    tasks: TaskSourceConfig = TaskSourceConfig()
    """What ``flywheel run`` submits (read by the CLI only)."""
    stages: list[Literal["sft", "rl"]] = ["rl"]
    """What ``flywheel run`` does, in order: ``sft`` fine-tunes ``model.name`` on the ``sft`` section's
    transcripts (``flywheel sft``), ``rl`` is the RL run; ``[sft, rl]`` starts the RL run from the SFT model
    (``model.name`` set to ``sft.output``, which is also its KL reference)."""
    sft: SftConfig | None = None
    """The supervised fine-tuning stage (:class:`trainer_service.config.SftConfig`); needed by ``flywheel sft``
    and by ``stages`` with ``sft``."""

    @model_validator(mode="after")
    def _stages(self) -> "FlywheelConfig":
        """Raises ValueError for an empty or repeated ``stages``, ``rl`` before ``sft``, or ``sft`` without an
        ``sft`` section."""
        if self.stages not in (["rl"], ["sft"], ["sft", "rl"]):
            raise ValueError(f"stages: {self.stages} is not one of [rl], [sft], [sft, rl]")
        if "sft" in self.stages and self.sft is None:
            raise ValueError("stages: sft needs an sft: section (at least sft.data)")
        return self


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> FlywheelConfig:
    """Build the root config from a YAML file, the environment and ``overrides`` (:meth:`Settings.load`).

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ValueError: the file's top level is not a mapping, or the environment sets a field and its sub-field.
        pydantic.ValidationError: a field is unknown, moved or out of bounds (the message names it).
    """
    return FlywheelConfig.load(path, **overrides)
