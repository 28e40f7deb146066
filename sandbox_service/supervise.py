"""W's side of each run: clone the run process R, watch it, collect its outputs, report one result frame.

W learns only the run's limits (numbers) from R, enforces the wall deadline, reads stdout, stderr, the
test-result channel and R's status note into :class:`Capture` buffers that it zeroes after the run,
empties the slot's cgroup and writes the result frame (header, then the raw parts) to the service.
What runs inside R and C is :mod:`sandbox_service.run_process`; the process tree is described in
:mod:`sandbox_service.worker`.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import selectors
import shutil
import signal
import time
from dataclasses import dataclass

import orjson

from sandbox_service import isolation
from sandbox_service.frames import send_frame, write_all
from sandbox_service.run_process import NO_MORE_REQUESTS, REQUEST_FAILED, SETUP_FAILED, STATUS_CAP, _run
from sandbox_service.slot import Worker

READ_CHUNK = 65536
KILL_SLACK_BYTES = 1024 * 1024
"""A stream may run this far past its cap (or the cap again, whichever is larger) before the run is killed."""
RESULT_CHANNEL_CAP = 4 * 1024 * 1024
DRAIN_GRACE_S = 0.5


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


def serve(w: Worker) -> None:
    """Clone a run process ahead of each request and supervise it, until the service closes the pipe."""
    write_frame(1, {"ready": True, "pid": os.getpid(), "slot": w.slot})
    # Everything allocated so far is permanent: the collector never walks (and so never
    # copies-on-write) the worker's objects in a run process.
    gc.collect()
    gc.freeze()
    while Run(w).supervise():
        pass
    if w.cg:
        w.cg.remove()
    if w.root:
        isolation.umount(w.root)  # in this namespace the root is a mount; on the host, plain dirs
    shutil.rmtree(w.scratch, ignore_errors=True)


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
