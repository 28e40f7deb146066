"""Run one piece of submitted code in a separate, limited process.

Layers applied to every run (first version; a later issue adds namespaces, cgroups, seccomp...):

- a fresh private directory from :func:`tempfile.mkdtemp` holding the script and a working
  directory (the cwd, ``HOME`` and ``TMPDIR``), removed afterwards;
- the interpreter started with ``-I -B`` (isolated mode: no user site, no ``PYTHON*`` variables,
  no script directory on ``sys.path``) and a minimal environment, so nothing of the service's
  environment leaks in;
- rlimits set between fork and exec: RLIMIT_AS (memory), RLIMIT_CPU (a little above the wall
  limit), RLIMIT_FSIZE, RLIMIT_CORE = 0;
- its own session and process group (``start_new_session``), killed as a whole at the deadline
  and after the run (which also reaps anything the program left behind in that group);
- an unprivileged uid (``run_as_uid``, nobody by default) through ``setpriv`` when the service runs
  as root, with RLIMIT_NPROC bounding the processes of that uid;
- no network: the command is prefixed with ``unshare --net --fork`` (a new network namespace whose only
  interface is a down loopback) when :func:`probe_network_isolation` found that this works;
  otherwise runs are flagged ``network_isolated: false`` and ``degraded: ["network"]``;
- stdout and stderr read concurrently, keeping the first N bytes of each; a program that writes
  far past the cap is killed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_service.config import SandboxConfig
from sandbox_service.schemas import ExecuteRequest, ExecuteResult

log = logging.getLogger("sandbox.executor")

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
KILL_SLACK_BYTES = 1024 * 1024
"""A stream may run this many bytes (or the cap, whichever is larger) past its cap before the run is killed."""
DRAIN_GRACE_S = 1.0
"""After the process exits, how long to wait for its pipes to close (seconds)."""
_READ_CHUNK = 65536

_probe_cache: dict[str, bool] = {}
_active_pgids: set[int] = set()


def resolve_python(cfg: SandboxConfig) -> str:
    """Absolute path of the interpreter for submitted code.

    Raises:
        FileNotFoundError: ``cfg.python`` names nothing executable.
    """
    if cfg.python is None:
        return sys.executable
    found = shutil.which(cfg.python)
    if not found:
        raise FileNotFoundError(f"sandbox python {cfg.python!r} not found on PATH")
    return os.path.abspath(found)


def drop_to_uid(cfg: SandboxConfig) -> int | None:
    """The uid submitted code runs as, or ``None`` to keep the service's (not root, or dropping is off)."""
    if cfg.run_as_uid is None or os.geteuid() != 0 or shutil.which("setpriv", path=SAFE_PATH) is None:
        return None
    return cfg.run_as_uid


def unshare_binary() -> str | None:
    """Path of util-linux ``unshare``, or ``None`` when it is not installed."""
    return shutil.which("unshare", path=SAFE_PATH + ":/usr/sbin:/sbin")


_PROBE_CODE = (
    "import socket, sys\n"
    "names = [n for _, n in socket.if_nameindex()]\n"
    "sys.exit(0 if names == ['lo'] else 3)\n"
)


async def probe_network_isolation(cfg: SandboxConfig, timeout_s: float = 10.0) -> bool:
    """Whether ``unshare --net`` can give a run a private network namespace here (cached per interpreter).

    Runs the interpreter once inside a new network namespace and checks that it sees only ``lo``.
    Never raises: any failure (no ``unshare``, EPERM without CAP_SYS_ADMIN, timeout) gives ``False``.
    """
    try:
        python = resolve_python(cfg)
    except FileNotFoundError:
        return False
    if python in _probe_cache:
        return _probe_cache[python]
    ok = False
    unshare = unshare_binary()
    if unshare:
        try:
            proc = await asyncio.create_subprocess_exec(
                unshare, "--net", python, "-I", "-c", _PROBE_CODE,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, env={"PATH": SAFE_PATH},
            )
            try:
                _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                err = b"probe timed out"
            ok = proc.returncode == 0
            if not ok:
                log.warning("network isolation unavailable: unshare --net exited %s: %s",
                            proc.returncode, err.decode(errors="replace").strip()[-300:])
        except OSError as e:
            log.warning("network isolation unavailable: %s", e)
    else:
        log.warning("network isolation unavailable: no unshare binary (apt install util-linux)")
    _probe_cache[python] = ok
    return ok


def _limits_preexec(memory_bytes: int, cpu_s: int, fsize_bytes: int, nproc: int | None = None):
    """A preexec_fn that sets the run's rlimits in the child (between fork and exec)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return apply


@dataclass
class _Stream:
    cap: int
    data: bytearray = field(default_factory=bytearray)
    total: int = 0

    @property
    def truncated(self) -> bool:
        return self.total > self.cap


async def _pump(reader: asyncio.StreamReader, s: _Stream, overflow: asyncio.Event) -> None:
    """Read ``reader`` to EOF, keeping the first ``s.cap`` bytes; set ``overflow`` far past the cap."""
    kill_at = s.cap + max(s.cap, KILL_SLACK_BYTES)
    while True:
        chunk = await reader.read(_READ_CHUNK)
        if not chunk:
            return
        s.total += len(chunk)
        room = s.cap - len(s.data)
        if room > 0:
            s.data += chunk[:room]
        if s.total > kill_at:
            overflow.set()  # keep draining (and discarding) so the pipe can close once the group is killed


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Stream protocol that also signals process exit on its own.

    ``Process.wait()`` on Python 3.11.7+ returns only once every pipe is closed too, which a
    grandchild that keeps the pipes open would delay forever; ``exited`` does not wait for pipes.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
        await writer.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all_active() -> None:
    """SIGKILL the process group of every run still in flight (used at service shutdown)."""
    for pgid in list(_active_pgids):
        _killpg(pgid)


def _write_files(workdir: Path, files: dict[str, str]) -> None:
    root = workdir.resolve()
    for name, content in files.items():
        target = (workdir / name).resolve()
        if root not in target.parents:
            raise ValueError(f"file path {name!r} leaves the working directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


def _classify(exit_code: int | None, timed_out: bool, overflowed: bool, truncated: bool, stderr: bytes) -> str:
    if timed_out or exit_code == -signal.SIGXCPU:
        return "timeout"
    if overflowed:
        return "output_limit"
    if exit_code != 0 and b"MemoryError" in stderr:
        return "memory_limit"
    if truncated:
        return "output_limit"
    if exit_code is not None and exit_code < 0:
        return "killed"
    return "ok" if exit_code == 0 else "runtime_error"


async def execute(req: ExecuteRequest, cfg: SandboxConfig, *, network_isolated: bool | None = None) -> ExecuteResult:
    """Run ``req.code`` once under the limits of ``req`` (defaults from ``cfg``) and report what happened.

    Args:
        req: the validated request (timeout in seconds, memory in MiB, output cap in bytes).
        cfg: service settings (defaults, interpreter, file-size limit).
        network_isolated: whether to prefix ``unshare --net``; ``None`` = use :func:`probe_network_isolation`.

    Returns:
        The result. Failures of the service itself (cannot create the directory, cannot spawn)
        come back as status ``infra_error`` with the reason on ``stderr``; this never raises for them.

    Raises:
        asyncio.CancelledError: the caller was cancelled (the run's process group is killed first).
    """
    run_id = uuid.uuid4().hex
    timeout_s = req.timeout_s if req.timeout_s is not None else cfg.default_timeout_s
    memory_mb = req.memory_mb if req.memory_mb is not None else cfg.default_memory_mb
    cap = req.output_limit_bytes if req.output_limit_bytes is not None else cfg.default_output_limit_bytes
    if network_isolated is None:
        network_isolated = await probe_network_isolation(cfg)
    degraded = [] if network_isolated else ["network"]

    def infra(msg: str, wall_s: float = 0.0) -> ExecuteResult:
        return ExecuteResult(run_id=run_id, status="infra_error", exit_code=None, stdout="", stderr=msg,
                             wall_s=wall_s, network_isolated=network_isolated, degraded=degraded)

    rundir: Path | None = None
    try:
        try:
            python = resolve_python(cfg)
            rundir = Path(tempfile.mkdtemp(prefix="flywheel-sbx-"))
            workdir = rundir / "work"
            workdir.mkdir()
            script = rundir / "main.py"
            script.write_text(req.code, encoding="utf-8")
            _write_files(workdir, req.files)
        except (OSError, ValueError) as e:
            return infra(f"sandbox: cannot prepare the run: {e}")

        argv = [python, "-I", "-B", str(script)]
        uid = drop_to_uid(cfg)
        if uid is not None:
            for path in (rundir, workdir, script, *workdir.rglob("*")):
                os.chown(path, uid, uid)
            argv = [shutil.which("setpriv", path=SAFE_PATH), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "--", *argv]
        if network_isolated:
            unshare = unshare_binary()
            if unshare is None:
                return infra("sandbox: unshare disappeared after the start-up probe")
            # --fork: the code's parent is this unshare process, not the service (killing it cannot kill us)
            argv = [unshare, "--net", "--fork", *argv]
        env = {
            "PATH": SAFE_PATH,
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        cpu_s = int(timeout_s) + 2
        preexec = _limits_preexec(memory_mb * 1024 * 1024, cpu_s, cfg.file_size_limit_bytes,
                                  cfg.max_processes if uid is not None else None)

        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _Protocol(limit=_READ_CHUNK * 4, loop=loop),
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=str(workdir), env=env, start_new_session=True, preexec_fn=preexec,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return infra(f"sandbox: cannot spawn the interpreter: {e}", time.monotonic() - t0)
        proc = asyncio.subprocess.Process(transport, protocol, loop)

        pgid = proc.pid
        _active_pgids.add(pgid)
        out, err = _Stream(cap), _Stream(cap)
        overflow = asyncio.Event()
        tasks = [
            asyncio.create_task(_pump(proc.stdout, out, overflow)),
            asyncio.create_task(_pump(proc.stderr, err, overflow)),
            asyncio.create_task(_feed(proc.stdin, req.stdin.encode("utf-8"))),
        ]
        exited = asyncio.create_task(protocol.exited.wait())
        over = asyncio.create_task(overflow.wait())
        timed_out = overflowed = False
        try:
            done, _ = await asyncio.wait({exited, over}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if exited not in done:
                overflowed = overflow.is_set()
                timed_out = not overflowed
                _killpg(pgid)
                await exited
            wall_s = time.monotonic() - t0
            # The leader is gone; kill whatever it left in its group, then let the pipes drain.
            _killpg(pgid)
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_GRACE_S)
            for t in pending:
                t.cancel()
        finally:
            _killpg(pgid)
            _active_pgids.discard(pgid)
            for t in (*tasks, exited, over):
                if not t.done():
                    t.cancel()
            transport.close()  # closes the pipes; the child watcher still reaps the process

        exit_code = proc.returncode
        status = _classify(exit_code, timed_out, overflowed, out.truncated or err.truncated, bytes(err.data))
        return ExecuteResult(
            run_id=run_id, status=status, exit_code=exit_code,
            stdout=out.data.decode("utf-8", errors="replace"), stderr=err.data.decode("utf-8", errors="replace"),
            stdout_truncated=out.truncated, stderr_truncated=err.truncated, wall_s=round(wall_s, 4),
            network_isolated=network_isolated, degraded=degraded,
        )
    finally:
        if rundir is not None:
            shutil.rmtree(rundir, ignore_errors=True)

