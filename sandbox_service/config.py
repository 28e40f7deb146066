"""Configuration of the sandbox service (section ``sandbox`` of the system config)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.config import Settings

Layer = Literal["cgroups", "landlock", "namespaces", "seccomp", "uid"]


class SandboxConfig(BaseModel):
    """Sandbox HTTP service settings. Env names: ``FLYWHEEL_SANDBOX__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Interface the HTTP server binds to."""
    port: int = Field(8100, ge=0, le=65535)
    """TCP port of the HTTP server (0 = pick a free one; the launcher passes a concrete one)."""
    max_concurrency: int = Field(4, ge=1, le=256)
    """Warm workers (slots), each running one execution at a time; more executions wait in a queue.
    About 2 per core: a run spends part of its time in the kernel and in the service, so two per core
    keep the CPUs busy (154 vs 138-142 executions/s with 2 workers on 2 cores)."""
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=1024**3)
    """Largest request body accepted (bytes); larger ones get HTTP 413 before they are read (a body sent
    without ``Content-Length`` is counted while received and refused once past it: ``shared.http.BodyLimit``)."""
    max_queued: int = Field(256, ge=0, le=100_000)
    """Executions that may wait for a free slot; a request beyond this gets HTTP 503 at once."""
    default_timeout_s: float = Field(5.0, gt=0, le=300)
    """Wall-clock limit of one execution when the request gives none (seconds)."""
    default_memory_mb: int = Field(512, ge=16, le=65536)
    """Memory limit of one execution when the request gives none (MiB; see ``ExecuteRequest.memory_mb``)."""
    default_output_limit_bytes: int = Field(65536, ge=1024, le=64 * 1024 * 1024)
    """Bytes of stdout and of stderr kept per execution; the rest is dropped and flagged."""
    default_max_processes: int = Field(64, ge=1, le=4096)
    """Processes and threads one execution may have at once (pids cgroup, RLIMIT_NPROC)."""
    default_disk_mb: int = Field(64, ge=1, le=4096)
    """Size of an execution's /work and of its /tmp (fresh tmpfs each run, MiB)."""
    cpu_cores: float = Field(1.0, gt=0, le=256)
    """CPU quota of one execution (cores; cgroup cpu controller)."""
    python: str | None = None
    """Interpreter for ``fresh_interpreter`` runs and the workers (a name on PATH or an absolute path);
    ``None`` = the interpreter running the service itself."""
    allow_degraded: bool = False
    """Start even when an isolation layer is unavailable (or listed in ``disable_layers``). Every
    result then names the missing layers in ``degraded``. Off: the service refuses to start."""
    disable_layers: list[Layer] = Field(default_factory=list)
    """Layers to switch off on purpose (needs ``allow_degraded``); for hosts where one misbehaves."""
    uid_base: int | None = Field(60000, ge=1, le=2**31 - 4096)
    """Slot i runs code as uid and gid ``uid_base + i`` (no passwd entry, owns nothing on the host) when
    the service runs as root; ``None`` keeps the service's uid (reported as degraded ``uid``)."""
    recycle_after_runs: int = Field(1000, ge=1, le=10**9)
    """A worker is replaced by a fresh one after this many executions."""
    retries: int = Field(2, ge=0, le=10)
    """Extra attempts when the environment fails (worker died, set-up failed), before ``infra_error``."""
    health_check_interval_s: float = Field(30.0, ge=0, le=3600)
    """Seconds between canary runs on each idle worker (a failed canary replaces the worker); 0 = off."""
    worker_start_timeout_s: float = Field(30.0, gt=0, le=600)
    """How long a new worker may take to report ready (seconds)."""
    breaker_window: int = Field(20, ge=1, le=10_000)
    """Circuit breaker: the last this many executions are watched for ending in ``infra_error``."""
    breaker_failure_ratio: float = Field(0.5, gt=0, le=1)
    """Circuit breaker: it opens when at least this share of the window failed (and the window is full)."""
    breaker_cooldown_s: float = Field(10.0, gt=0, le=3600)
    """Circuit breaker: seconds it stays open (HTTP 503, /healthz 503) before the service runs a canary
    execution as its trial (success closes it, failure starts another cool-down)."""
    max_sessions: int = Field(64, ge=0, le=10_000)
    """Sessions (``POST /v1/sessions``) open at once; one more gets HTTP 503."""
    max_workspace_mb: int = Field(256, ge=1, le=65536)
    """Largest unpacked workspace (``PUT /v1/workspaces/{digest}``, MiB); a larger one gets HTTP 422."""
    sessions_disk_mb: int = Field(4096, ge=16, le=1024**2)
    """Size of the one tmpfs that holds every workspace template and every session's layers (MiB; mounted at
    start, before the workers, and removed at shutdown). Pages are used only as files are written."""
    session_disk_mb: int = Field(256, ge=1, le=65536)
    """A session's disk limit when ``POST /v1/sessions`` gives none: once its snapshot layers and current
    changes hold more than this after a run, the session is ended (MiB)."""
    max_snapshots: int = Field(32, ge=1, le=128)
    """Snapshots a session may hold (each is one overlayfs layer); one more gets HTTP 409."""


class SandboxSettings(Settings):
    """What the sandbox process reads: its section and ``kafka``, ``model``, ``run``."""

    sandbox: SandboxConfig = SandboxConfig()
