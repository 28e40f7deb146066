"""The supervisor's records of a local system's processes: how a dead process is restarted
(:class:`RestartPolicy`), each death seen (:class:`SupervisorEvent`), one supervised service process and its
restart bookkeeping (:class:`ServiceProcess`), why a process ended (:func:`exit_reason`), a log's last lines,
and the peak RSS and CPU seconds of a process read from ``/proc``. :class:`flywheel.launcher.LocalSystem`
uses them."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RestartPolicy:
    """How the supervisor restarts a dead process (a service or the broker).

    A process may die ``max_restarts`` times within any ``window_s`` seconds and be restarted; the next
    counted death in the window stops the system (a count over the whole run would stop a
    run whose third crash came hours after the second). Before its k-th restart in a row a service waits
    ``min(backoff_max_s, backoff_initial_s · 2^(k-1))`` seconds; a process that ran ``stable_s`` seconds
    before dying starts a new row (1 s again). The broker restarts at once (every service waits on it).
    Deaths of services within ``broker_grace_s`` seconds after the broker died are not counted and
    restart after ``backoff_initial_s``.
    """

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0
    broker_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_initial_s < 0 or self.stable_s < 0:
            raise ValueError(f"invalid restart policy {self}")
        if self.backoff_max_s < self.backoff_initial_s or self.broker_grace_s < 0:
            raise ValueError(f"invalid restart policy {self}")

    def backoff_s(self, streak: int) -> float:
        """Wait before the ``streak``-th restart in a row (1-based), seconds."""
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, streak - 1))


@dataclass
class SupervisorEvent:
    """One death seen by the supervisor: ``at`` (Unix s), the ``process`` (``broker`` or a service name), its
    ``pid``, the ``reason`` (``exit code 1``, ``killed by SIGKILL``), whether it ``counted`` towards the
    restart window, and the ``new_pid`` once restarted."""

    at: float
    process: str
    pid: int
    reason: str
    counted: bool
    new_pid: int | None = None


def exit_reason(code: int) -> str:
    """``exit code N`` for a normal exit, ``killed by SIGNAME`` for a negative (signal) return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of the log at ``path`` (``(no log)`` when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServiceProcess:
    """One supervised service process and its restart bookkeeping (monotonic seconds)."""

    name: str
    process: subprocess.Popen
    log_path: Path
    restarts: int = 0
    """Restarts over the whole run (for the record; the limit uses :attr:`crashes`)."""
    started_at: float = field(default_factory=time.monotonic)
    crashes: collections.deque = field(default_factory=collections.deque)
    """Times of the counted deaths within the window."""
    streak: int = 0
    """Restarts in a row without a stable period (sets the backoff)."""
    restart_at: float | None = None
    """When the scheduled respawn is due (``None``: running, or not yet seen dead)."""
    event: SupervisorEvent | None = None

    def tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (``utime`` + ``stime`` of ``/proc/<pid>/stat``); ``None``
    when the process is gone or the system has no such file."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def vm_hwm_bytes(pid: int) -> int | None:
    """Peak resident set size of process ``pid`` in bytes (``VmHWM`` of ``/proc/<pid>/status``); ``None`` when
    the process is gone or the system has no such file."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
