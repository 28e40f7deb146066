"""Configuration of the sandbox service (section ``sandbox`` of the system config)."""

from pydantic import BaseModel, ConfigDict, Field


class SandboxConfig(BaseModel):
    """Sandbox HTTP service settings. Env names: ``FLYWHEEL_SANDBOX__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Interface the HTTP server binds to."""
    port: int = Field(8100, ge=0, le=65535)
    """TCP port of the HTTP server (0 = pick a free one; the launcher passes a concrete one)."""
    max_concurrency: int = Field(2, ge=1, le=256)
    """Executions that may run at the same time; more wait in a queue."""
    max_queued: int = Field(256, ge=0, le=100_000)
    """Executions that may wait for a free slot; a request beyond this gets HTTP 503 at once."""
    default_timeout_s: float = Field(5.0, gt=0, le=300)
    """Wall-clock limit of one execution when the request gives none (seconds)."""
    default_memory_mb: int = Field(512, ge=16, le=65536)
    """Address-space limit of one execution when the request gives none (MiB)."""
    default_output_limit_bytes: int = Field(65536, ge=1024, le=64 * 1024 * 1024)
    """Bytes of stdout and of stderr kept per execution; the rest is dropped and flagged."""
    file_size_limit_bytes: int = Field(16 * 1024 * 1024, ge=4096, le=4 * 1024**3)
    """Largest file one execution may write (RLIMIT_FSIZE, bytes)."""
    python: str | None = None
    """Interpreter that runs submitted Python code (a name looked up on PATH or an absolute path);
    ``None`` = the interpreter running the service itself."""
    require_network_isolation: bool = False
    """Refuse to start when a private network namespace cannot be created (else run degraded and say so)."""
    run_as_uid: int | None = Field(65534, ge=1, le=2**31)
    """Unprivileged uid (and gid) that submitted code runs as when the service runs as root (via util-linux
    ``setpriv``; 65534 = nobody): it cannot read root-only files such as /etc/shadow or write into the
    service's own files. ``None`` runs code as the service's own uid."""
    max_processes: int = Field(64, ge=1, le=100000)
    """RLIMIT_NPROC of a run when it runs as ``run_as_uid`` (bounds fork bombs; counted per uid)."""

