"""Inside the run process R and the program's process C: everything a run does after W cloned R.

R forks C before any request exists, reads the request from the service's pipe, tells W the limits,
sets the run up (cgroup limits, fresh /work and /tmp, /proc, pivot_root into the read-only root),
releases C and stays as the pid namespace's init; C confines itself (rlimits, slot uid,
no_new_privs, Landlock, seccomp) and runs the code. The exit codes and the fixed fd numbers here are
what W (:mod:`sandbox_service.supervise`) reads back.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import sys
from dataclasses import dataclass

import orjson

from sandbox_service import harness, isolation
from sandbox_service.frames import read_frame, send_frame
from sandbox_service.layers import own_tree
from sandbox_service.slot import Worker

STATUS_CAP = 4096
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


def _write_tree_nofollow(root: str, files: dict[str, str], uid: int | None) -> None:
    """Write ``files`` under ``root`` (a session's workspace, which may hold symlinks a run made) without
    following any symlink: every directory is opened relative to its parent with ``O_NOFOLLOW``, the file
    itself too, and owners are set on descriptors. A symlink on the way fails the write (OSError ELOOP or
    ENOTDIR), the caller's fault. R is root: following one could write any host file."""
    for name, content in files.items():
        parts = name.split("/")
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, 0o755, dir_fd=dfd)
                    made = True
                except FileExistsError:
                    made = False
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd = nfd
                if made and uid is not None:
                    os.fchown(dfd, uid, uid)
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dfd)
            try:
                if uid is not None and os.fstat(fd).st_uid == 0:
                    os.fchown(fd, uid, uid)
                data = content.encode("utf-8")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        finally:
            os.close(dfd)


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
    host_tmp: str = ""
    session: bool = False
    """/work is a session's workspace (overlayfs): the program's source goes to /tmp, and the request's
    files are written without following symlinks."""


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
        dirs = _make_run_dirs(w, lim, rundir, req.get("session"))
        source = SOURCE_NAMES[req["language"]]
        _write_run_files(w, req, source, dirs)
        if w.root:  # C shares this mount namespace and root: pivot_root moves it too
            isolation.mount("proc", os.path.join(w.root, "proc"), "proc",
                            isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC)
            isolation.pivot_root_here(w.root)
        stdin = _prime_stdin(req.get("stdin", ""), link.stdin_w)
        tests = req.get("tests")
        go = {"language": req["language"], "fresh": bool(req.get("fresh_interpreter")), "limits": lim,
              "work": dirs.work, "tmp": dirs.tmp,
              "path": os.path.join(dirs.tmp if dirs.session else dirs.work, source),
              "serve": tests is not None, "session": dirs.session}
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
        # on top of what earlier runs left charged to the slot (session files on the sessions' tmpfs)
        w.cg.set_limits(lim["memory_mb"] * 2**20 + w.cg.base_bytes, lim["max_processes"] + 2)
        w.cg.attach(child, only=("memory", "cpuacct"))  # its memory and CPU time, not W's
        with open(f"/proc/{child}/oom_score_adj", "w") as f:  # the OOM killer's first choice
            f.write("1000")
        w.cg.attach(0, only=("memory",))  # R too: the files it writes and what it reads from C count


def _make_run_dirs(w: Worker, lim: dict, rundir: str | None, session: dict | None = None) -> _RunDirs:
    """R: the run's fresh /work and /tmp, each ``disk_mb`` MiB: tmpfs mounts in the prepared root, or,
    without namespaces, directories under ``rundir`` (owned by the slot uid). With a ``session`` (from the
    service, never the caller: ``dir`` and the relative ``lower`` layers), /work is instead an overlayfs of
    the session's layers whose changes go to its ``upper`` directory, handed to the slot uid first
    (:mod:`sandbox_service.sessions`). Raises OSError."""
    opts = f"size={lim['disk_mb']}m,mode=0700" + (f",uid={w.uid},gid={w.uid}" if w.uid is not None else "")
    if w.root:
        flags = isolation.MS_NOSUID | isolation.MS_NODEV
        if session is not None:
            isolation.mount("tmpfs", os.path.join(w.root, "tmp"), "tmpfs", flags, opts)
            try:
                own_tree(os.path.join(session["dir"], "upper"), w.uid)
            except OSError as e:  # what earlier runs of the session made, never the environment's fault
                raise RequestError(f"sandbox: the session's workspace cannot be handed to this run: {e}") from None
            os.chdir(session["dir"])  # the layers' paths are relative: the mount data is one page
            isolation.mount("overlay", os.path.join(w.root, "work"), "overlay", flags,
                            f"lowerdir={session['lower']},upperdir=upper,workdir=work,index=off,metacopy=off,"
                            "redirect_dir=off")
            os.chdir("/")
            return _RunDirs(os.path.join(w.root, "work"), "/work", "/tmp", os.path.join(w.root, "tmp"), True)
        for d in ("work", "tmp"):
            isolation.mount("tmpfs", os.path.join(w.root, d), "tmpfs", flags, opts)
        return _RunDirs(os.path.join(w.root, "work"), "/work", "/tmp")
    work, tmp = os.path.join(rundir, "work"), os.path.join(rundir, "tmp")
    os.mkdir(rundir, 0o711)
    for d in (work, tmp):
        os.mkdir(d, 0o700)
        if w.uid is not None:
            os.chown(d, w.uid, w.uid)
    return _RunDirs(work, work, tmp)


def _write_run_files(w: Worker, req: dict, source: str, dirs: _RunDirs) -> None:
    """R: write the code (as ``source``) and the request's files into the run's /work, owned by the slot uid
    (in a session: the code into /tmp, the files into the workspace without following symlinks).

    Raises:
        RequestError: they do not fit the run's disk or memory limit (or another OSError writing them).
    """
    lim = req["limits"]
    try:
        if dirs.session:
            _write_tree(dirs.host_tmp, {source: req["code"]}, w.uid)
            _write_tree_nofollow(dirs.host_work, req.get("files", {}), w.uid)
        else:
            _write_tree(dirs.host_work, {source: req["code"], **req.get("files", {})}, w.uid)
    except OSError as e:
        raise RequestError(f"sandbox: the run's files do not fit (disk_mb={lim['disk_mb']}, "
                           f"memory_mb={lim['memory_mb']}) or a path in the workspace is not a directory: {e}") from None


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
        if go.get("session"):  # the source is in /tmp: the workspace's modules import as from its directory
            sys.path.insert(0, work)
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
