"""Request and response bodies of ``POST /v1/execute`` (the sandbox's public HTTP contract)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.schemas import require_utf8

Status = Literal["ok", "runtime_error", "timeout", "memory_limit", "output_limit", "killed", "infra_error"]
"""Outcome of one execution.

- ``ok``: the program exited with code 0.
- ``runtime_error``: it exited with a non-zero code.
- ``timeout``: killed at the wall-clock deadline, or by the CPU-time limit (SIGXCPU).
- ``memory_limit``: non-zero exit with ``MemoryError`` on stderr (the address-space limit was hit).
- ``output_limit``: stdout or stderr went past the output cap (the kept part is flagged truncated);
  a program that keeps writing far past the cap is killed.
- ``killed``: ended by some other signal.
- ``infra_error``: the service itself failed (could not create the directory, spawn the interpreter...);
  the message is on ``stderr``. It is never the program's fault: callers should retry, not score it.
"""

MAX_FILES = 256
MAX_FILES_BYTES = 32 * 1024 * 1024


class ExecuteRequest(BaseModel):
    """Body of ``POST /v1/execute``. Unknown fields are rejected (HTTP 422 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(min_length=1, max_length=16 * 1024 * 1024)
    """Program source, run as the main script."""
    language: Literal["python"] = "python"
    """Language of ``code``; only ``python`` for now."""
    stdin: str = Field("", max_length=64 * 1024 * 1024)
    """Text fed to the program's standard input (UTF-8), then closed."""
    files: dict[str, str] = Field(default_factory=dict)
    """Text files created in the working directory before the run: relative POSIX path -> content (UTF-8)."""
    timeout_s: float | None = Field(None, gt=0, le=300, allow_inf_nan=False)
    """Wall-clock limit (seconds); ``None`` = the service default."""
    memory_mb: int | None = Field(None, ge=16, le=65536)
    """Address-space limit (MiB, RLIMIT_AS); ``None`` = the service default."""
    output_limit_bytes: int | None = Field(None, ge=1, le=64 * 1024 * 1024)
    """Bytes of stdout and of stderr kept (each); ``None`` = the service default."""

    @field_validator("code")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("code contains a NUL character (Python would stop reading there)")
        return v

    @field_validator("files")
    @classmethod
    def _check_files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_FILES:
            raise ValueError(f"at most {MAX_FILES} files")
        if sum(len(c) for c in v.values()) > MAX_FILES_BYTES:
            raise ValueError(f"files hold more than {MAX_FILES_BYTES} characters in all")
        seen: dict[PurePosixPath, str] = {}
        for name in v:
            p = PurePosixPath(name)
            if not name or "\x00" in name or "\\" in name or p.is_absolute() or ".." in p.parts or p == PurePosixPath("."):
                raise ValueError(f"file path {name!r} must be relative, without '..', NUL or backslashes")
            if any(len(part.encode("utf-8")) > 255 for part in p.parts) or len(name.encode("utf-8")) > 1024:
                raise ValueError(f"file path {name[:64]!r}... is too long (255 bytes a name, 1024 a path)")
            if p in seen:
                raise ValueError(f"file paths {seen[p]!r} and {name!r} name the same file")
            seen[p] = name
        for p, name in seen.items():  # a file cannot also be a directory of another file
            clash = next((seen[d] for d in p.parents if d in seen), None)
            if clash is not None:
                raise ValueError(f"file path {name!r} needs {clash!r} to be a directory, but it is a file")
        return v

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        return require_utf8(data)


class ExecuteResult(BaseModel):
    """Body of the HTTP 200 answer of ``POST /v1/execute``."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    """Unique id of this execution (also in the service log)."""
    status: Status
    """Outcome; see :data:`Status`."""
    exit_code: int | None
    """Process exit code; negative = killed by that signal; ``None`` when no process ran."""
    stdout: str
    """Kept standard output (UTF-8, undecodable bytes replaced)."""
    stderr: str
    """Kept standard error (UTF-8, undecodable bytes replaced)."""
    stdout_truncated: bool = False
    """The program wrote more stdout than the output limit."""
    stderr_truncated: bool = False
    """The program wrote more stderr than the output limit."""
    wall_s: float
    """Wall-clock time from spawn to exit (seconds)."""
    network_isolated: bool
    """The run had a private network namespace (no interface but a down loopback)."""
    degraded: list[str] = Field(default_factory=list)
    """Isolation layers that were wanted but unavailable for this run (e.g. ``network``)."""
