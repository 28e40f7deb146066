"""A warm sandbox worker: one per slot, started by :mod:`sandbox_service.pool`, one run at a time.

Process tree of one run (``S`` = the service, ``W`` = this worker, set up once)::

    S --pipes--> W  (own mount/net/ipc/uts namespaces; read-only root prepared; modules pre-imported)
                 └─ A  supervisor, forked *before* the request arrives; reads the request itself,
                    │   so no request or output ever sits in W's memory for a later run to find
                    └─ B  pid 1 of a new pid namespace, in the slot's cgroup; pivot_root into the
                          read-only root with fresh tmpfs /work and /tmp; rlimits, setsid, slot uid,
                          no_new_privs, Landlock, seccomp; then runs the code (in the pre-imported
                          interpreter for Python, ``execve`` for bash, C and C++)

A enforces the wall deadline (SIGKILL to B, which takes the whole pid namespace with it), caps
stdout/stderr, reads test results from the private channel, empties the cgroup, and writes one
result frame to S. W only forks the next A. Frames on the S<->W pipes are a 4-byte big-endian
length and an orjson object. Each layer is applied only when the start-up probe found it working
and the service did not switch it off; what was skipped is reported in every result as ``degraded``.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import secrets
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import orjson

from sandbox_service import harness, isolation
from sandbox_service.cgroups import SlotCgroup

READ_CHUNK = 65536
KILL_SLACK_BYTES = 1024 * 1024
"""A stream may run this far past its cap (or the cap again, whichever is larger) before the run is killed."""
RESULT_CHANNEL_CAP = 4 * 1024 * 1024
DRAIN_GRACE_S = 0.5
SETUP_FAILED = 121
"""Exit code of B when its own set-up failed (the error text comes on the status pipe)."""
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
SOURCE_NAMES = {"python": "main.py", "bash": "main.sh", "c": "main.c", "cpp": "main.cpp"}


# ---------------------------------------------------------------- frames


def read_frame(fd: int) -> dict | None:
    """Read one length-prefixed orjson frame from ``fd``; None at EOF. Raises ValueError on a torn frame."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    body = _read_exact(fd, n)
    if body is None:
        raise ValueError("EOF inside a frame")
    return orjson.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def write_frame(fd: int, obj: dict) -> None:
    """Write ``obj`` as one length-prefixed orjson frame to ``fd``."""
    body = orjson.dumps(obj)
    data = struct.pack(">I", len(body)) + body
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---------------------------------------------------------------- worker set-up


class Worker:
    """State fixed for the worker's life: slot, uid, layers, the prepared root and the cgroup."""

    def __init__(self, slot: str, uid: int | None, layers: list[str], cgroup: str | None, landlock_abi: int,
                 python: str) -> None:
        self.slot, self.uid, self.layers, self.landlock_abi, self.python = slot, uid, set(layers), landlock_abi, python
        self.cg = SlotCgroup(cgroup, slot) if cgroup and "cgroups" in self.layers else None
        self.root: str | None = None
        self.seccomp = None
        self.scratch = tempfile.mkdtemp(prefix=f"flywheel-sbx-{slot}-")

    def setup(self) -> None:
        """Create the slot cgroup, enter the worker's namespaces and build the read-only root. Raises OSError."""
        if self.cg:
            self.cg.create()
        if "namespaces" in self.layers:
            isolation.unshare(isolation.CLONE_NEWNS | isolation.CLONE_NEWNET | isolation.CLONE_NEWIPC
                              | isolation.CLONE_NEWUTS)
            isolation.mount("none", "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
            socket.sethostname("sandbox")
            self.root = self._build_root()
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
            if p == "/" or p.startswith("/usr/") or p == "/usr":
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
        """Fork a supervisor per run until the service closes the request pipe."""
        write_frame(1, {"ready": True, "pid": os.getpid(), "slot": self.slot})
        # Everything allocated so far is permanent: the collector in A and B never walks (and so never
        # copies-on-write) the worker's objects, which makes each fork much cheaper.
        gc.collect()
        gc.freeze()
        while True:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
                    code = Supervisor(self).run_one()
                except BaseException as e:  # noqa: BLE001 - must reach the service as infra_error
                    try:
                        write_frame(1, {"infra_error": f"supervisor failed: {type(e).__name__}: {e}"})
                    except OSError:
                        pass
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            if code == 3:  # EOF on the request pipe: the service is done with this worker
                break
            if code not in (0, 1):
                write_frame(1, {"infra_error": f"supervisor died with status {code}"})
        if self.cg:
            self.cg.remove()
        shutil.rmtree(self.scratch, ignore_errors=True)


# ---------------------------------------------------------------- one run


class Supervisor:
    """Process A: reads one request, starts B, watches it, writes one result frame."""

    def __init__(self, w: Worker) -> None:
        self.w = w

    def run_one(self) -> int:
        """Handle one request; the exit code for W (0 done, 3 no more requests)."""
        req = read_frame(0)
        if req is None:
            return 3
        w = self.w
        token = secrets.token_hex(16)
        lim = req["limits"]
        degraded = sorted(set(isolation_layers()) - w.layers)
        if w.cg:
            w.cg.configure(lim["memory_mb"] * 2**20, lim["max_processes"], lim["cpu_cores"])
        if w.root:
            isolation.unshare(isolation.CLONE_NEWNS | isolation.CLONE_NEWPID)
            opts = f"size={lim['disk_mb']}m,mode=0700" + (f",uid={w.uid},gid={w.uid}" if w.uid is not None else "")
            for d in ("work", "tmp"):
                isolation.mount("tmpfs", os.path.join(w.root, d), "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, opts)
            host_work, work, tmp = os.path.join(w.root, "work"), "/work", "/tmp"
        else:
            base = tempfile.mkdtemp(prefix="run-", dir=w.scratch)
            host_work, tmp = os.path.join(base, "work"), os.path.join(base, "tmp")
            for d in (w.scratch, base):
                os.chmod(d, 0o711)  # the slot uid may pass through, not list
            for d in (host_work, tmp):
                os.mkdir(d, 0o700)
                if w.uid is not None:
                    os.chown(d, w.uid, w.uid)
            work = host_work
        source = SOURCE_NAMES[req["language"]]
        try:
            _write_tree(host_work, {source: req["code"], **req.get("files", {})}, w.uid)
        except OSError as e:
            write_frame(1, _result("runtime_error", None, b"",
                                   f"sandbox: cannot write the run's files: {e}".encode(), degraded=degraded))
            return 0
        pipes = {k: os.pipe() for k in ("stdin", "stdout", "stderr", "results", "status")}
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _run_b(w, req, pipes, work, tmp, source, token)  # never returns
        for k, (r, wr) in pipes.items():
            os.close(r if k == "stdin" else wr)
        result = self._watch(req, pid, pipes, t0, token, degraded)
        if not w.root:
            shutil.rmtree(os.path.dirname(host_work), ignore_errors=True)
        write_frame(1, result)
        return 0

    def _watch(self, req: dict, pid: int, pipes: dict, t0: float, token: str, degraded: list[str]) -> dict:
        lim = req["limits"]
        cap = lim["output_limit_bytes"]
        kill_at = cap + max(cap, KILL_SLACK_BYTES)
        bufs = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray(), "status": bytearray()}
        totals = dict.fromkeys(bufs, 0)
        caps = {"stdout": cap, "stderr": cap, "results": RESULT_CHANNEL_CAP, "status": 4096}
        sel = selectors.DefaultSelector()
        for k in ("stdout", "stderr", "results", "status"):
            os.set_blocking(pipes[k][0], False)
            sel.register(pipes[k][0], selectors.EVENT_READ, k)
        stdin = memoryview(req.get("stdin", "").encode("utf-8"))
        stdin_fd = pipes["stdin"][1]
        os.set_blocking(stdin_fd, False)
        if stdin:
            sel.register(stdin_fd, selectors.EVENT_WRITE, "stdin")
        else:
            os.close(stdin_fd)
        pidfd = os.pidfd_open(pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        deadline = t0 + lim["timeout_s"]
        timed_out = overflow = exited = False
        exit_at = 0.0
        while True:
            now = time.monotonic()
            if not exited and not timed_out and now >= deadline:
                timed_out = True
                _kill(pid)
            readers = [k for k in sel.get_map().values() if k.data in bufs]
            if exited and (not readers or now > exit_at + DRAIN_GRACE_S):
                break
            if exited:
                wait = exit_at + DRAIN_GRACE_S - now
            else:
                wait = 0.05 if timed_out else deadline - now
            for key, _ in sel.select(timeout=max(wait, 0.0)):
                k = key.data
                if k == "exit":
                    sel.unregister(pidfd)
                    exited, exit_at = True, time.monotonic()
                    self._sweep(pid)  # B is gone; kill whatever escaped it so the pipes can close
                elif k == "stdin":
                    try:
                        stdin = stdin[os.write(stdin_fd, stdin[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        stdin = stdin[:0]
                    if not stdin:
                        sel.unregister(stdin_fd)
                        os.close(stdin_fd)
                else:
                    try:
                        chunk = os.read(key.fd, READ_CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(key.fd)
                        os.close(key.fd)
                        continue
                    totals[k] += len(chunk)
                    room = caps[k] - len(bufs[k])
                    if room > 0:
                        bufs[k] += chunk[:room]
                    if k in ("stdout", "stderr") and totals[k] > kill_at and not overflow:
                        overflow = True
                        _kill(pid)
        wall = time.monotonic() - t0
        if not exited:
            _kill(pid)
        _, status, ru = os.wait4(pid, 0)
        os.close(pidfd)
        for key in list(sel.get_map().values()):
            os.close(key.fd)
        sel.close()
        self._sweep(pid)
        cg = self.w.cg
        oom = peak = cpu = None
        if cg:
            oom, peak, cpu = cg.oom_killed(), cg.peak_memory_bytes(), cg.cpu_seconds()
        if cpu is None:
            cpu = ru.ru_utime + ru.ru_stime
        if peak is None:
            peak = ru.ru_maxrss * 1024
        code = os.waitstatus_to_exitcode(status)
        if code == SETUP_FAILED and bufs["status"]:
            return _infra(f"sandbox set-up failed: {bufs['status'].decode(errors='replace')}", wall, degraded)
        status_name = _classify(code, timed_out, overflow, bool(oom), lim, cpu, bufs["stderr"],
                                totals["stdout"] > cap or totals["stderr"] > cap)
        res = _result(status_name, code, bytes(bufs["stdout"]), bytes(bufs["stderr"]),
                      stdout_truncated=totals["stdout"] > cap, stderr_truncated=totals["stderr"] > cap,
                      wall_s=round(wall, 4), cpu_s=round(cpu, 4), peak_memory_bytes=peak, degraded=degraded)
        if req.get("tests") is not None:
            res.update(_test_results(req, bytes(bufs["results"]), token, status_name))
        return res


    def _sweep(self, pid: int) -> None:
        """Kill every process the run left: the slot's cgroup, else B's process group (B called setsid)."""
        if self.w.cg:
            self.w.cg.kill_all()
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def isolation_layers() -> list[str]:
    """Every layer the full isolation has (the names used in ``degraded``)."""
    return ["cgroups", "landlock", "namespaces", "seccomp", "uid"]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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


def _classify(code: int, timed_out: bool, overflow: bool, oom: bool, lim: dict, cpu: float, stderr: bytearray,
              truncated: bool) -> str:
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if overflow:
        return "output_limit"
    if oom or (code != 0 and b"MemoryError" in stderr[-4096:]):
        return "memory_limit"
    if code == -signal.SIGKILL and cpu >= lim["cpu_time_s"]:
        return "timeout"
    if truncated:
        return "output_limit"
    if code < 0:
        return "killed"
    return "ok" if code == 0 else "runtime_error"


def _result(status: str, code: int | None, out: bytes, err: bytes, **kw) -> dict:
    res = {"status": status, "exit_code": code, "stdout": out.decode("utf-8", errors="replace"),
           "stderr": err.decode("utf-8", errors="replace"), "wall_s": 0.0}
    res.update(kw)
    return res


def _infra(msg: str, wall: float, degraded: list[str]) -> dict:
    return {"status": "infra_error", "exit_code": None, "stdout": "", "stderr": msg, "wall_s": round(wall, 4),
            "degraded": degraded}


def _test_results(req: dict, channel: bytes, token: str, status: str) -> dict:
    """Per-test results from the private channel; lines without this run's token are ignored."""
    tests = req["tests"]
    got: dict[int, dict] = {}
    foreign = 0
    for line in channel.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            foreign += 1
            continue
        if not isinstance(rec, dict) or rec.get("token") != token:
            foreign += 1
            continue
        i = rec.get("i")
        if isinstance(i, int) and 0 <= i < len(tests) and i not in got:
            got[i] = rec
    missing = "timeout" if status == "timeout" else "not_run"
    out = []
    for i, t in enumerate(tests):
        rec = got.get(i)
        if rec is None:
            out.append({"name": t["name"], "status": missing, "message": f"no result reported (run status {status})",
                        "seconds": None})
        else:
            out.append({"name": t["name"], "status": rec.get("status", "error"), "message": rec.get("message", ""),
                        "seconds": rec.get("seconds")})
    passed = sum(r["status"] == "passed" for r in out)
    return {"tests": out, "tests_passed": passed, "tests_total": len(out), "foreign_result_lines": foreign}


def _run_b(w: Worker, req: dict, pipes: dict, work: str, tmp: str, source: str, token: str) -> None:
    """Process B: isolate itself in order, then run the code. Never returns."""
    status_w = pipes["status"][1]
    try:
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        if w.cg:
            w.cg.attach()
        if w.root:
            # a mount namespace of B's own: pivot_root must not move A (which still needs the host's
            # /sys/fs/cgroup) into the sandbox root
            isolation.unshare(isolation.CLONE_NEWNS)
            isolation.mount("proc", os.path.join(w.root, "proc"), "proc",
                            isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC)
            isolation.pivot_root_here(w.root)
        os.setsid()
        keep = {0: pipes["stdin"][0], 1: pipes["stdout"][1], 2: pipes["stderr"][1],
                harness.RESULT_FD: pipes["results"][1]}
        status_fd = 100
        os.dup2(status_w, status_fd)
        for target, fd in keep.items():
            os.dup2(fd, target, inheritable=True)
        os.closerange(harness.RESULT_FD + 1, status_fd)
        os.closerange(status_fd + 1, 65536)
        status_w = status_fd
        lim = req["limits"]
        mem = lim["memory_mb"] * 2**20
        vsz = _vsize()
        as_limit = mem + (2**30 if w.cg else vsz)  # with a cgroup, RSS is bounded there; AS only stops huge mallocs
        for res_, val in ((resource.RLIMIT_AS, as_limit), (resource.RLIMIT_CPU, int(lim["cpu_time_s"]) + 1),
                          (resource.RLIMIT_FSIZE, lim["disk_mb"] * 2**20), (resource.RLIMIT_CORE, 0),
                          (resource.RLIMIT_NOFILE, 256)):
            resource.setrlimit(res_, (val, val))
        if w.uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_processes"], lim["max_processes"]))
            os.setgroups([])
            os.setresgid(w.uid, w.uid, w.uid)
            os.setresuid(w.uid, w.uid, w.uid)
        isolation.set_no_new_privs()
        if "landlock" in w.layers and w.landlock_abi:
            isolation.landlock_restrict(["/"], [work, tmp], ["/dev/null"], w.landlock_abi)
        if w.seccomp is not None:
            w.seccomp.load()
        os.chdir(work)
        env = dict(SANDBOX_ENV, HOME=work, TMPDIR=tmp)
        os.environ.clear()
        os.environ.update(env)
        os.close(status_w)
    except BaseException as e:  # noqa: BLE001 - reported to A as an infrastructure failure
        try:
            os.write(status_w, f"{type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(SETUP_FAILED)
    path = os.path.join(work, source)
    lang = req["language"]
    try:
        if lang == "python":
            if req.get("tests") is not None:
                harness.run_tests(path, req["tests"], req.get("entry_point"), token)
            elif req.get("fresh_interpreter"):
                os.execve(w.python, [w.python, "-I", "-B", path], env)
            else:
                harness.run_script(path)
        elif lang == "bash":
            os.execve("/bin/bash", ["bash", path], env)
        else:
            compiler, std = ("gcc", "-std=c17") if lang == "c" else ("g++", "-std=c++17")
            binary = os.path.join(tmp, "a.out")
            os.execve("/bin/sh", ["sh", "-c", f'{compiler} {std} -O1 -o "$1" "$2" -lm && exec "$1"', "sh", binary, path],
                      env)
    except OSError as e:
        os.write(2, f"sandbox: cannot start {lang}: {e}\n".encode())
        os._exit(127)
    os._exit(0)


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
    a = ap.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops workers by closing the pipe or SIGKILL
    w = Worker(a.slot, a.uid, [x for x in a.layers.split(",") if x], a.cgroup, a.landlock_abi, a.python)
    try:
        w.setup()
    except BaseException as e:  # noqa: BLE001
        write_frame(1, {"ready": False, "error": f"worker set-up failed: {type(e).__name__}: {e}"})
        shutil.rmtree(w.scratch, ignore_errors=True)
        sys.exit(1)
    w.serve()


if __name__ == "__main__":
    main()
