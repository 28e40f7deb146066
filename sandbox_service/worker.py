"""A warm sandbox worker: one per slot, started by :mod:`sandbox_service.pool`, one run at a time.

Process tree of one run (``S`` = the service, ``W`` = this worker, set up once)::

    S --pipes--> W  own mount/net/ipc/uts namespaces; read-only root prepared; modules pre-imported;
                 │  supervises each run but never sees a request (hygiene, see below)
                 └─ R  cloned *before* the request arrives, straight into new pid, mount and IPC
                    │  namespaces (pid 1 there), in a session of its own. R reads the request itself
                    │  from S's pipe and sets the run up: slot cgroup limits, fresh size-limited
                    │  tmpfs /work and /tmp, /proc, pivot_root into the read-only root. Then it stays
                    │  as init (feeding stdin; in test-harness mode, running the tests)
                    └─ C  forked by R before the request existed; confines itself (rlimits, slot uid,
                          no_new_privs, Landlock, seccomp) and runs the code (in the pre-imported
                          interpreter for Python; ``execve`` for bash, C, C++)

W learns only the run's limits (numbers) from R, enforces the wall deadline (SIGKILL to R takes
the whole pid namespace with it), reads stdout, stderr and the test-result channel into byte
buffers that it zeroes after the run, empties the cgroup, and writes one result frame to S. The
request (code, tests, stdin) never enters W's memory, and outputs only as zeroed byte buffers, so
nothing of one run can be found in the heap that the next run is cloned from; C never held the
request at all.

Frames on the S<->W pipes: a 4-byte big-endian length and an orjson object; a result frame is
followed by its raw parts (stdout, stderr, results channel, set-up error), their lengths in the
header's ``parts``. Each layer is applied only when the start-up probe found it working and the
service did not switch it off; the service reports the rest as ``degraded``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import select
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from sandbox_service import harness, isolation
from sandbox_service.frames import read_frame, send_frame, write_all
from sandbox_service.cgroups import SlotCgroup

READ_CHUNK = 65536
KILL_SLACK_BYTES = 1024 * 1024
"""A stream may run this far past its cap (or the cap again, whichever is larger) before the run is killed."""
RESULT_CHANNEL_CAP = 4 * 1024 * 1024
STATUS_CAP = 4096
DRAIN_GRACE_S = 0.5
SETUP_FAILED = 121
"""Exit code of R when its own set-up failed (the error text comes on the status pipe)."""
NO_MORE_REQUESTS = 3
"""Exit code of R when the service closed the request pipe."""
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
SOURCE_NAMES = {"python": "main.py", "bash": "main.sh", "c": "main.c", "cpp": "main.cpp"}
_STATUS_FD, _CTL_FD, _RSP_FD, _STDIN_FD = 100, 101, 102, 103
"""Where R keeps its status pipe (set-up errors, then the program's wait status) and where R and C keep
their link (the go message; in test-harness mode, calls into the solution and its answers)."""
REQUEST_FAILED = 122
"""Exit code of R when the request itself cannot run (the reason comes on the status pipe)."""


# ---------------------------------------------------------------- frames


def write_frame(fd: int, obj: dict, parts: tuple = ()) -> None:
    """Write ``obj`` as one length-prefixed orjson frame to ``fd``, then each part raw.

    A part is a :class:`Capture` (or a list of bytes-like buffers); their lengths go in ``obj["parts"]``.
    """
    parts = [p.views() if isinstance(p, Capture) else p for p in parts]
    if parts:
        obj = dict(obj, parts=[sum(len(b) for b in bufs) for bufs in parts])
    send_frame(fd, obj)
    for b in (b for bufs in parts for b in bufs):
        write_all(fd, b)


class Capture:
    """The first ``cap`` bytes of a stream, read straight into fixed chunks (counting the rest).

    No bytes object ever holds the data and no chunk is reallocated, so :meth:`zero` really wipes
    it. Chunks start at 4 KiB and grow to 64 KiB, so a short output costs a small buffer.
    """

    FIRST, CHUNK = 4096, 65536

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.total = cap, 0, 0
        self.chunks: list[list] = []  # [bytearray, used]

    def read_from(self, fd: int, sink: bytearray) -> int:
        """One read from ``fd``; bytes past the cap go to ``sink`` and are only counted. 0 = EOF."""
        room = self.cap - self.kept
        if room <= 0:
            n = os.readv(fd, [sink])
        else:
            if not self.chunks or self.chunks[-1][1] == len(self.chunks[-1][0]):
                size = min(self.CHUNK, self.FIRST * 4 ** len(self.chunks))
                self.chunks.append([bytearray(size), 0])
            c = self.chunks[-1]
            n = os.readv(fd, [memoryview(c[0])[c[1]:c[1] + min(room, len(c[0]) - c[1])]])
            c[1] += n
            self.kept += n
        self.total += n
        return n

    def views(self) -> list[memoryview]:
        """The kept bytes, as views into the chunks (no copy)."""
        return [memoryview(c)[:used] for c, used in self.chunks]

    def last_line_startswith(self, prefix: bytes) -> bool:
        """Whether the last non-empty line kept starts with ``prefix`` (looked for in the last chunk only)."""
        if not self.chunks:
            return False
        c, used = self.chunks[-1]
        end = used
        while end > 0 and c[end - 1] in b"\r\n":
            end -= 1
        start = c.rfind(b"\n", 0, end) + 1
        return c.startswith(prefix, start, end)

    def zero(self) -> None:
        """Overwrite the kept bytes with zeros in place (memset), before the chunks are freed."""
        for c, used in self.chunks:
            if used:
                ctypes.memset((ctypes.c_char * used).from_buffer(c), 0, used)


# ---------------------------------------------------------------- the worker


class Worker:
    """State fixed for the worker's life: slot, uid, layers, the prepared root, the cgroup, the seccomp program."""

    def __init__(self, slot: str, uid: int | None, layers: list[str], cgroup: str | None, landlock_abi: int,
                 python: str, cpu_cores: float = 1.0) -> None:
        self.slot, self.uid, self.layers, self.landlock_abi, self.python = slot, uid, set(layers), landlock_abi, python
        self.cpu_cores = cpu_cores
        self.cg = SlotCgroup(cgroup, slot) if cgroup and "cgroups" in self.layers else None
        self.root: str | None = None
        self.seccomp: isolation.SeccompProgram | None = None
        self.scratch = tempfile.mkdtemp(prefix=f"flywheel-sbx-{slot}-")

    def setup(self) -> None:
        """Create the slot cgroup, enter the worker's namespaces, build the read-only root. Raises OSError."""
        if self.cg:
            # W lives in its slot's pids and cpu cgroups, so each run process starts there; only the
            # memory and CPU-time accounting cgroups are joined per run, by the run's processes alone
            # (W's own buffers never count against a run). W itself is never swept.
            self.cg.create()
            self.cg.set_cpu_quota(self.cpu_cores)
            self.cg.attach(only=("pids", "cpu"))
        if "namespaces" in self.layers:
            isolation.unshare(isolation.CLONE_NEWNS | isolation.CLONE_NEWNET | isolation.CLONE_NEWIPC
                              | isolation.CLONE_NEWUTS)
            isolation.mount("none", "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
            socket.sethostname("sandbox")
            self.root = self._build_root()
        else:
            os.chmod(self.scratch, 0o711)  # the slot uid may pass through to its run directory, not list
        if "seccomp" in self.layers:
            self.seccomp = isolation.SeccompProgram()
        harness.preload()

    def _build_root(self) -> str:
        """A tmpfs with read-only binds of /usr, /etc (shadow files masked) and the interpreter's prefix."""
        root = os.path.join(self.scratch, "root")
        os.mkdir(root)
        isolation.mount("tmpfs", root, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, "size=1m,mode=755")
        for d in ("usr", "etc", "dev", "proc", "work", "tmp"):
            os.mkdir(os.path.join(root, d))
        for link in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
            host = Path("/") / link
            if host.is_symlink():
                os.symlink(os.readlink(host), os.path.join(root, link))
            elif host.is_dir():
                os.mkdir(os.path.join(root, link))
                isolation.bind_readonly(str(host), os.path.join(root, link))
        isolation.bind_readonly("/usr", os.path.join(root, "usr"))
        isolation.bind_readonly("/etc", os.path.join(root, "etc"))
        for secret in ("shadow", "gshadow", "shadow-", "gshadow-", "sudoers"):
            if os.path.exists(os.path.join(root, "etc", secret)):
                isolation.mount("/dev/null", os.path.join(root, "etc", secret), None, isolation.MS_BIND)
        prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                  os.path.dirname(os.path.dirname(os.path.realpath(self.python))))}
        for p in sorted(prefixes):
            if p == "/" or p == "/usr" or p.startswith("/usr/"):
                continue
            target = root + p
            os.makedirs(target, mode=0o755, exist_ok=True)
            isolation.bind_readonly(p, target)
            for parent in Path(target).parents:  # e.g. /root is 0700 on the host, 0755 here
                if str(parent).startswith(root + "/"):
                    os.chmod(parent, 0o755)
        for dev in ("null", "zero", "urandom", "random"):
            path = os.path.join(root, "dev", dev)
            open(path, "w").close()
            isolation.mount(f"/dev/{dev}", path, None, isolation.MS_BIND)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, os.path.join(root, "dev", name))
        isolation.mount("none", root, None, isolation.MS_REMOUNT | isolation.MS_RDONLY | isolation.MS_NOSUID
                        | isolation.MS_NODEV)
        return root

    def serve(self) -> None:
        """Clone a run process ahead of each request and supervise it, until the service closes the pipe."""
        write_frame(1, {"ready": True, "pid": os.getpid(), "slot": self.slot})
        # Everything allocated so far is permanent: the collector never walks (and so never
        # copies-on-write) the worker's objects in a run process.
        gc.collect()
        gc.freeze()
        while Run(self).supervise():
            pass
        if self.cg:
            self.cg.remove()
        if self.root:
            isolation.umount(self.root)  # in this namespace the root is a mount; on the host, plain dirs
        shutil.rmtree(self.scratch, ignore_errors=True)


@dataclass
class _Watch:
    """W's view of one run in progress: R's pid, its limits, the buffers its pipes are read into, and
    how it has ended so far. Times are ``time.monotonic()`` seconds; ``cap`` and ``kill_at`` are bytes."""

    pid: int
    lim: dict
    t0: float
    deadline: float
    cap: int
    kill_at: int
    bufs: dict[str, Capture]
    sink: bytearray
    sel: selectors.BaseSelector
    pidfd: int
    timed_out: bool = False
    overflow: bool = False
    exited: bool = False
    exit_at: float = 0.0

    @classmethod
    def open(cls, pid: int, lim: dict, pipes: dict) -> _Watch:
        """Start watching R ``pid`` now: a buffer per pipe (stdout and stderr capped at the run's output
        limit), each pipe non-blocking in a selector along with R's pidfd, the wall deadline set
        ``lim["timeout_s"]`` seconds from now. Raises OSError."""
        t0 = time.monotonic()
        cap = lim["output_limit_bytes"]
        kill_at = cap + max(cap, KILL_SLACK_BYTES)
        caps = {"stdout": cap, "stderr": cap, "results": RESULT_CHANNEL_CAP, "status": STATUS_CAP}
        bufs = {k: Capture(c) for k, c in caps.items()}
        sink = bytearray(READ_CHUNK)
        sel = selectors.DefaultSelector()
        for k in caps:
            os.set_blocking(pipes[k][0], False)
            sel.register(pipes[k][0], selectors.EVENT_READ, k)
        pidfd = os.pidfd_open(pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        deadline = t0 + lim["timeout_s"]
        return cls(pid, lim, t0, deadline, cap, kill_at, bufs, sink, sel, pidfd)


class Run:
    """One run, seen from W: clone R, learn its limits, watch it, report."""

    def __init__(self, w: Worker) -> None:
        self.w = w

    def supervise(self) -> bool:
        """Handle one request; False when the service has no more."""
        w = self.w
        names = ("stdout", "stderr", "results", "status", "limits")
        pipes = {k: os.pipe() for k in names}
        if w.cg:
            w.cg.reset_counters()
        rundir = None if w.root else os.path.join(w.scratch, "run")
        if w.root:
            # a fresh IPC namespace too: System V shared memory or queues die with the run
            pid = isolation.clone_process(isolation.CLONE_NEWPID | isolation.CLONE_NEWNS | isolation.CLONE_NEWIPC)
        else:
            pid = os.fork()
        if pid == 0:
            _run(w, pipes, rundir)  # never returns
        for r, wr in pipes.values():
            os.close(wr)
        try:
            limits = _read_all(pipes["limits"][0], 4096)  # R's first words: numbers only, never the request
            os.close(pipes["limits"][0])
            if not limits:  # R ended before reading a request
                _, status = os.waitpid(pid, 0)
                for k in names[:-1]:
                    os.close(pipes[k][0])
                code = os.waitstatus_to_exitcode(status)
                if code == NO_MORE_REQUESTS:
                    return False
                write_frame(1, {"status": "infra_error", "error": f"run process died before its request (status {code})"})
                return True
            header, parts = self._watch(pid, orjson.loads(limits), pipes)
            write_frame(1, header, parts)
            for p in parts:
                if isinstance(p, Capture):
                    p.zero()  # wipe what the run wrote before the buffers are freed
            return True
        finally:
            if rundir:
                shutil.rmtree(rundir, ignore_errors=True)

    def _watch(self, pid: int, lim: dict, pipes: dict) -> tuple[dict, tuple]:
        """Watch R until it ends (or is killed at the wall deadline or for flooding its output), then reap
        it and report: the result frame's header and its parts (stdout, stderr, results, status).

        ``wall_s`` runs from the start of the watch to the end of the reading (seconds). Raises OSError.
        """
        wt = _Watch.open(pid, lim, pipes)
        self._pump(wt)
        wall = time.monotonic() - wt.t0
        status, ru = self._reap(wt)
        return self._report(wt, wall, status, ru)

    def _pump(self, wt: _Watch) -> None:
        """Read R's pipes into their buffers until R has ended and they are drained (or the drain grace,
        :data:`DRAIN_GRACE_S` seconds, is over); kill R at the wall deadline. Raises OSError."""
        while True:
            now = time.monotonic()
            if not wt.exited and not wt.timed_out and now >= wt.deadline:
                wt.timed_out = True
                _kill(wt.pid)
            readers = [k for k in wt.sel.get_map().values() if k.data in wt.bufs]
            if wt.exited and (not readers or now > wt.exit_at + DRAIN_GRACE_S):
                break
            wait = wt.exit_at + DRAIN_GRACE_S - now if wt.exited else (0.05 if wt.timed_out else wt.deadline - now)
            for key, _ in wt.sel.select(timeout=max(wait, 0.0)):
                self._on_ready(wt, key)

    def _on_ready(self, wt: _Watch, key: selectors.SelectorKey) -> None:
        """One ready event: R's exit (then, without a pid namespace, sweep what it left so the pipes
        close), or one read from a pipe (closed at EOF; R killed once stdout or stderr passes
        ``kill_at`` bytes). Raises OSError."""
        k = key.data
        if k == "exit":
            wt.sel.unregister(wt.pidfd)
            wt.exited, wt.exit_at = True, time.monotonic()
            if not self.w.root:  # no pid namespace took the rest with R: kill it so the pipes close
                self._sweep(wt.pid)
            return
        try:
            n = wt.bufs[k].read_from(key.fd, wt.sink)
        except BlockingIOError:
            return
        if n == 0:
            wt.sel.unregister(key.fd)
            os.close(key.fd)
        elif k in ("stdout", "stderr") and wt.bufs[k].total > wt.kill_at and not wt.overflow:
            wt.overflow = True
            _kill(wt.pid)

    def _reap(self, wt: _Watch) -> tuple[int, resource.struct_rusage]:
        """Kill R if it still runs, reap it (its wait status and resource usage), close the pipes left, zero
        the overflow buffer and sweep the slot. Raises OSError."""
        if not wt.exited:
            _kill(wt.pid)
        _, status, ru = os.wait4(wt.pid, 0)
        os.close(wt.pidfd)
        for key in list(wt.sel.get_map().values()):
            os.close(key.fd)
        wt.sel.close()
        ctypes.memset((ctypes.c_char * len(wt.sink)).from_buffer(wt.sink), 0, len(wt.sink))
        self._sweep(wt.pid)
        return status, ru

    def _report(self, wt: _Watch, wall: float, status: int, ru: resource.struct_rusage) -> tuple[dict, tuple]:
        """The result frame for a reaped run: R's set-up or request failure if its status note says so,
        else the program's own status (relayed by R), classified. ``wall`` in seconds; CPU time in
        seconds (the cgroup's, else what R measured, else R's own rusage); peak memory in bytes."""
        cg = self.w.cg
        oom = peak = cpu = None
        if cg:
            oom, peak, cpu = cg.oom_killed(), cg.peak_memory_bytes(), cg.cpu_seconds()
        if peak is None:
            peak = ru.ru_maxrss * 1024
        code = os.waitstatus_to_exitcode(status)
        bufs, lim, cap = wt.bufs, wt.lim, wt.cap
        parts = (bufs["stdout"], bufs["stderr"], bufs["results"], bufs["status"])
        note = bytes(bufs["status"].views()[0]) if bufs["status"].total else b""  # R's own words, never the code's
        if code == SETUP_FAILED and note:
            return {"status": "infra_error", "error": "sandbox set-up failed", "wall_s": round(wall, 4)}, parts
        if code == REQUEST_FAILED and note.startswith(b"request: "):
            return {"status": "runtime_error", "exit_code": None, "message": note[9:].decode(errors="replace"),
                    "wall_s": round(wall, 4), "cpu_s": 0.0, "peak_memory_bytes": None}, parts[:3] + ([],)
        if code == 0 and note.startswith(b"wait:"):  # the program's own status and CPU time, relayed by R
            raw_status, _, cpu_s = note[5:].partition(b":")
            code = os.waitstatus_to_exitcode(int(raw_status))
            if cpu is None and cpu_s:
                cpu = float(cpu_s)
        if cpu is None:
            cpu = ru.ru_utime + ru.ru_stime
        truncated = {k: bufs[k].total > cap for k in ("stdout", "stderr")}
        status_name = _classify(code, wt.timed_out, wt.overflow, bool(oom), lim, cpu, bufs["stderr"],
                                truncated["stdout"] or truncated["stderr"], python=lim.get("language") == "python")
        header = {"status": status_name, "exit_code": code, "stdout_truncated": truncated["stdout"],
                  "stderr_truncated": truncated["stderr"], "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                  "peak_memory_bytes": peak}
        return header, parts

    def _sweep(self, pid: int) -> None:
        """Kill every process the run left: the slot's cgroup, and R's process group (R called setsid;
        without a pid namespace that is what reaches C's tree)."""
        if self.w.cg:
            self.w.cg.kill_all(keep=os.getpid())
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_all(fd: int, cap: int) -> bytes:
    out = b""
    while len(out) < cap:
        chunk = os.read(fd, cap - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _classify(code: int, timed_out: bool, overflow: bool, oom: bool, lim: dict, cpu: float, stderr: Capture,
              truncated: bool, python: bool) -> str:
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if overflow:
        return "output_limit"
    if code != 0 and (oom or (python and stderr.last_line_startswith(b"MemoryError"))):
        return "memory_limit"  # killed by the cgroup's OOM killer, or Python's own MemoryError ended it
    if code == -signal.SIGKILL and cpu >= lim["cpu_time_s"]:
        return "timeout"
    if truncated:
        return "output_limit"
    if code < 0:
        return "killed"
    return "ok" if code == 0 else "runtime_error"


# ---------------------------------------------------------------- inside R


def _write_tree(root: str, files: dict[str, str], uid: int | None) -> None:
    for name, content in files.items():
        target = os.path.join(root, name)
        parent = os.path.dirname(target)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(content)
        if uid is not None:
            os.chown(target, uid, uid)
            p = parent
            while len(p) > len(root):
                os.chown(p, uid, uid)
                p = os.path.dirname(p)


class RequestError(Exception):
    """The request cannot run as given (its files do not fit the disk or memory limit...): the
    caller's fault, reported as ``runtime_error``, never as an environment failure."""


@dataclass
class _ProgramLink:
    """R's ends of its pipes to C (made before C was forked): C's pid, the go message (then, with tests,
    calls) to C, the solution's answers from C, and the program's stdin."""

    child: int
    ctl_w: int
    rsp_r: int
    stdin_w: int


@dataclass
class _RunDirs:
    """The run's writable directories: ``work`` and ``tmp`` as the program sees them, ``host_work`` where
    R writes the run's files before pivot_root."""

    host_work: str
    work: str
    tmp: str


def _run(w: Worker, pipes: dict, rundir: str | None) -> None:
    """Process R: fork the program's process C at once (before any request exists in memory), read
    the request, set up the run, release C, then supervise it as the namespace's init. Never returns.

    With namespaces R is pid 1 of the run's pid namespace, so the program (C) is an ordinary process
    there: signals it sends itself, ``alarm`` and ``abort`` behave as usual. In test-harness mode R
    runs the tests and C only the solution (see :func:`sandbox_service.harness.run_tests`).
    """
    status_w = pipes["status"][1]
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()  # R's session and process group hold C too: no terminal, and one group for W to sweep
    for r, _ in pipes.values():
        os.close(r)
    ctl_r, ctl_w = os.pipe()  # R -> C: the go message, then (tests) calls
    rsp_r, rsp_w = os.pipe()  # C -> R: (tests) the solution's answers
    stdin_r, stdin_w = os.pipe()
    child = os.fork()
    if child == 0:  # forked here, not in a helper: the program's code runs no deeper in the stack
        _program(w, pipes, ctl_r, rsp_w, stdin_r, close=(ctl_w, rsp_r, stdin_w))  # never returns
    for fd in (ctl_r, rsp_w, stdin_r):
        os.close(fd)
    link = _ProgramLink(child, ctl_w, rsp_r, stdin_w)
    try:
        req = _read_request(pipes["limits"][1])
        lim = req["limits"]
        _join_cgroups(w, lim, link.child)
        dirs = _make_run_dirs(w, lim, rundir)
        source = SOURCE_NAMES[req["language"]]
        _write_run_files(w, req, source, dirs.host_work)
        if w.root:  # C shares this mount namespace and root: pivot_root moves it too
            isolation.mount("proc", os.path.join(w.root, "proc"), "proc",
                            isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC)
            isolation.pivot_root_here(w.root)
        stdin = _prime_stdin(req.get("stdin", ""), link.stdin_w)
        tests = req.get("tests")
        go = {"language": req["language"], "fresh": bool(req.get("fresh_interpreter")), "limits": lim,
              "work": dirs.work, "tmp": dirs.tmp, "path": os.path.join(dirs.work, source),
              "serve": tests is not None}
        send_frame(link.ctl_w, go)
        _keep_fds(pipes, link, status_w)
        status_w = _STATUS_FD
        if tests is not None:  # R runs the tests' code: it gets every layer too (and is not dumpable)
            _confine(w, lim, dirs.work, dirs.tmp, init=True)
        else:  # R only waits, as root: the program (another uid) can neither signal nor trace it
            isolation.set_no_new_privs()
    except RequestError as e:
        os.write(status_w, f"request: {e}".encode()[:STATUS_CAP])
        os._exit(REQUEST_FAILED)
    except BaseException as e:  # noqa: BLE001 - reported to W as an infrastructure failure
        try:
            os.write(status_w, f"{type(e).__name__}: {e}".encode()[:STATUS_CAP])
        finally:
            os._exit(SETUP_FAILED)
    if tests is None:
        _feed(stdin)  # while the program runs; it returns at once when the pipe took it all
    else:
        os.close(_STDIN_FD)
        harness.run_tests(tests, req.get("entry_point"), req["token"], _CTL_FD, _RSP_FD)
    _be_init(link.child, status_w)


def _read_request(limits_w: int) -> dict:
    """R: read the request from the service's pipe (exit with :data:`NO_MORE_REQUESTS` when it is closed)
    and tell W the run's limits on ``limits_w`` (numbers and the language only), then close it. Raises
    OSError, ValueError (a bad frame), KeyError (a request without its limits)."""
    req = read_frame(0)
    if req is None:
        os._exit(NO_MORE_REQUESTS)
    lim = req["limits"]
    os.write(limits_w, orjson.dumps({k: lim[k] for k in ("timeout_s", "cpu_time_s", "output_limit_bytes")}
                                    | {"language": req["language"]}))
    os.close(limits_w)
    return req


def _join_cgroups(w: Worker, lim: dict, child: int) -> None:
    """R: set the slot cgroup's memory (``memory_mb``) and process limits, put C (and R itself) in its
    memory cgroup and C in its CPU-time one, and make C the OOM killer's first choice. Nothing without
    cgroups. Raises OSError."""
    if w.cg:  # W (and so R and C) live in the slot's pids/cpu cgroups; the program joins its memory cgroup
        w.cg.set_limits(lim["memory_mb"] * 2**20, lim["max_processes"] + 2)
        w.cg.attach(child, only=("memory", "cpuacct"))  # its memory and CPU time, not W's
        with open(f"/proc/{child}/oom_score_adj", "w") as f:  # the OOM killer's first choice
            f.write("1000")
        w.cg.attach(0, only=("memory",))  # R too: the files it writes and what it reads from C count


def _make_run_dirs(w: Worker, lim: dict, rundir: str | None) -> _RunDirs:
    """R: the run's fresh /work and /tmp, each ``disk_mb`` MiB: tmpfs mounts in the prepared root, or,
    without namespaces, directories under ``rundir`` (owned by the slot uid). Raises OSError."""
    opts = f"size={lim['disk_mb']}m,mode=0700" + (f",uid={w.uid},gid={w.uid}" if w.uid is not None else "")
    if w.root:
        for d in ("work", "tmp"):
            isolation.mount("tmpfs", os.path.join(w.root, d), "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, opts)
        return _RunDirs(os.path.join(w.root, "work"), "/work", "/tmp")
    work, tmp = os.path.join(rundir, "work"), os.path.join(rundir, "tmp")
    os.mkdir(rundir, 0o711)
    for d in (work, tmp):
        os.mkdir(d, 0o700)
        if w.uid is not None:
            os.chown(d, w.uid, w.uid)
    return _RunDirs(work, work, tmp)


def _write_run_files(w: Worker, req: dict, source: str, host_work: str) -> None:
    """R: write the code (as ``source``) and the request's files into ``host_work``, owned by the slot uid.

    Raises:
        RequestError: they do not fit the run's disk or memory limit (or another OSError writing them).
    """
    lim = req["limits"]
    try:
        _write_tree(host_work, {source: req["code"], **req.get("files", {})}, w.uid)
    except OSError as e:
        raise RequestError(f"sandbox: the run's files do not fit (disk_mb={lim['disk_mb']}, "
                           f"memory_mb={lim['memory_mb']}): {e}") from None


def _prime_stdin(text: str, stdin_w: int) -> memoryview:
    """R: write what fits of the program's stdin into its pipe now (made non-blocking); the rest, which R
    feeds as init (:func:`_feed`), is returned."""
    stdin = memoryview(text.encode("utf-8"))
    os.set_blocking(stdin_w, False)
    try:
        stdin = stdin[os.write(stdin_w, stdin):]  # what fits in the pipe now; R feeds the rest as init
    except (BlockingIOError, BrokenPipeError):
        pass
    return stdin


def _keep_fds(pipes: dict, link: _ProgramLink, status_w: int) -> None:
    """R, before it confines itself: its status pipe and its ends of the link to C on their fixed numbers
    (:data:`_STATUS_FD` ...), stdin from /dev/null, stdout, stderr and the result channel on 1, 2 and
    :data:`harness.RESULT_FD`; every other fd closed. Raises OSError."""
    # R keeps: stdout/stderr (tests print there), the result channel, the status pipe, and the link to C
    os.dup2(status_w, _STATUS_FD)
    os.dup2(link.ctl_w, _CTL_FD)
    os.dup2(link.rsp_r, _RSP_FD)
    os.dup2(link.stdin_w, _STDIN_FD)
    devnull = os.open("/dev/null", os.O_RDONLY)
    for target, fd in ((0, devnull), (1, pipes["stdout"][1]), (2, pipes["stderr"][1]),
                       (harness.RESULT_FD, pipes["results"][1])):
        os.dup2(fd, target, inheritable=True)
    os.closerange(harness.RESULT_FD + 1, _STATUS_FD)
    os.closerange(_STDIN_FD + 1, 65536)


def _be_init(child: int, status_w: int) -> None:
    """R after stdin is fed or the tests ran: close the program's pipes, then reap every process until C
    ends, and write C's wait status and the CPU time (seconds) of everything reaped on ``status_w``.
    Never returns."""
    for fd in (0, 1, 2, harness.RESULT_FD, _CTL_FD, _RSP_FD, _STDIN_FD):
        try:
            os.close(fd)  # the program's pipes must close when it ends, not when R does
        except OSError:
            pass
    while True:  # init: reap everything until the program itself ends
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == child:  # its status, and the CPU time of every process R reaped (C's whole tree)
            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            os.write(status_w, f"wait:{status}:{ru.ru_utime + ru.ru_stime:.6f}".encode())
            os._exit(0)


def _feed(data: memoryview) -> None:
    """R: write the rest of stdin to the program as it reads, without another process (which would
    count against the run's process limit); stop when it is all written or the program closed its end
    (or ended). A program that never reads keeps R here until the deadline, like any hung run."""
    while data:
        try:
            _, writable, _ = select.select([], [_STDIN_FD], [], 0.05)
            if writable:
                data = data[os.write(_STDIN_FD, data[:65536]):]
        except BlockingIOError:
            continue
        except BrokenPipeError:  # the program closed stdin or ended
            break


def _program(w: Worker, pipes: dict, ctl_r: int, rsp_w: int, stdin_r: int, close: tuple) -> None:
    """Process C: wait for R's go (it never sees the request), confine itself, run the code. Never returns."""
    try:
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        for fd in (*close, 0, 1, pipes["results"][1], pipes["status"][1], pipes["limits"][1]):
            os.close(fd)  # the service's pipes, the result channel, R's ends
        go = read_frame(ctl_r)
        if go is None:  # no request (R ended)
            os._exit(0)
        lim, work, tmp = go["limits"], go["work"], go["tmp"]
        os.dup2(ctl_r, _CTL_FD)
        os.dup2(rsp_w, _RSP_FD)
        for target, fd in ((0, stdin_r), (1, pipes["stdout"][1]), (2, pipes["stderr"][1])):
            os.dup2(fd, target, inheritable=True)
        os.closerange(3, _CTL_FD)
        os.closerange(_RSP_FD + 1, 65536)
        if not go["serve"]:
            os.close(_CTL_FD)
            os.close(_RSP_FD)
        os.chdir(work)
        _confine(w, lim, work, tmp, init=False)
        env = dict(SANDBOX_ENV, HOME=work, TMPDIR=tmp)
        os.environ.clear()
        os.environ.update(env)
    except BaseException as e:  # noqa: BLE001 - R sees C end without a result
        try:
            os.write(2, f"sandbox: the program's process could not start: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(SETUP_FAILED)
    path, lang = go["path"], go["language"]
    try:
        if go["serve"]:
            harness.serve_solution(path, _CTL_FD, _RSP_FD)
        elif lang == "python":
            if go["fresh"]:
                os.execve(w.python, [w.python, "-I", "-B", path], env)
            harness.run_script(path)
        elif lang == "bash":
            os.execve("/bin/bash", ["bash", path], env)
        else:
            compiler, std = ("gcc", "-std=c17") if lang == "c" else ("g++", "-std=c++17")
            binary = os.path.join(tmp, "a.out")
            os.execve("/bin/sh", ["sh", "-c", f'{compiler} {std} -O1 -o "$1" "$2" -lm && exec "$1"', "sh", binary,
                                  path], env)
    except OSError as e:
        os.write(2, f"sandbox: cannot start {lang}: {e}\n".encode())
        os._exit(127)
    os._exit(0)


def _confine(w: Worker, lim: dict, work: str, tmp: str, init: bool) -> None:
    """The per-process layers, in order: rlimits, the slot uid, no_new_privs, Landlock, seccomp.

    ``init`` (R): also not dumpable, so the program cannot open R's /proc entries (its file
    descriptors, its memory) although both run as the slot uid.
    """
    mem = lim["memory_mb"] * 2**20
    as_limit = mem + (2**30 if w.cg else _vsize())  # with a cgroup, RSS is bounded there; AS stops huge mallocs
    for res_, val in ((resource.RLIMIT_AS, as_limit), (resource.RLIMIT_CPU, int(lim["cpu_time_s"]) + 1),
                      (resource.RLIMIT_FSIZE, lim["disk_mb"] * 2**20), (resource.RLIMIT_CORE, 0),
                      (resource.RLIMIT_NOFILE, 256)):
        resource.setrlimit(res_, (val, val))
    if w.uid is not None:
        nproc = lim["max_processes"] + 1  # R counts too
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setgroups([])
        os.setresgid(w.uid, w.uid, w.uid)
        os.setresuid(w.uid, w.uid, w.uid)
    if init:
        isolation.prctl(isolation.PR_SET_DUMPABLE, 0)
    isolation.set_no_new_privs()
    if "landlock" in w.layers and w.landlock_abi:  # per run: the rules must name this run's fresh tmpfs
        isolation.landlock_enforce(isolation.landlock_ruleset(["/"], [work, tmp], ["/dev/null"], w.landlock_abi))
    if w.seccomp is not None:
        w.seccomp.load()


def _vsize() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    """``python -m sandbox_service.worker --slot S --layers ...`` (started by the pool, not by users)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--uid", type=int, default=None)
    ap.add_argument("--layers", default="")
    ap.add_argument("--cgroup", default=None)
    ap.add_argument("--landlock-abi", type=int, default=0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cpu-cores", type=float, default=1.0)
    a = ap.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops workers by closing the pipe or SIGKILL
    w = Worker(a.slot, a.uid, [x for x in a.layers.split(",") if x], a.cgroup, a.landlock_abi, a.python, a.cpu_cores)
    try:
        w.setup()
    except BaseException as e:  # noqa: BLE001
        write_frame(1, {"ready": False, "error": f"worker set-up failed: {type(e).__name__}: {e}"})
        shutil.rmtree(w.scratch, ignore_errors=True)
        sys.exit(1)
    w.serve()


if __name__ == "__main__":
    main()
