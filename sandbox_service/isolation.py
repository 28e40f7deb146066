"""Kernel isolation primitives of the sandbox: namespaces, mounts, Landlock, seccomp, and the start-up probe.

Everything here is a thin, checked wrapper over a Linux system call (x86_64 and aarch64 numbers;
Python 3.11 has no ``os.unshare``). Each wrapper raises :class:`OSError` with the errno on failure.
The layering follows ``../shared/notes/sandbox-isolation.md`` section 4 (measured on this machine
kind); the per-run order is in :mod:`sandbox_service.run_process`.

References: unshare(2), mount(2), pivot_root(2), landlock(7) (ABI 1-7), seccomp(2) through
libseccomp (``pyseccomp``), prctl(2).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass, field

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38

_SYSCALLS = {  # name: (x86_64, aarch64)
    "clone": (56, 220),
    "pivot_root": (155, 41),
    "landlock_create_ruleset": (444, 444),
    "landlock_add_rule": (445, 445),
    "landlock_restrict_self": (446, 446),
}
_ARCH = 0 if platform.machine() in ("x86_64", "AMD64") else 1


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def _syscall(name: str, *args) -> int:
    return _check(_libc.syscall(ctypes.c_long(_SYSCALLS[name][_ARCH]), *args), name)


_pylibc = ctypes.PyDLL(None, use_errno=True)  # calls keep the GIL: the clone child must own it as fork's does
_pylibc.syscall.restype = ctypes.c_long
SIGCHLD = 17


def clone_process(flags: int) -> int:
    """``fork()`` straight into new namespaces: clone(2) with ``flags`` (``CLONE_NEW*``) and no new stack.

    Returns 0 in the child (pid 1 of its namespace when ``CLONE_NEWPID`` is in ``flags``) and the
    child's pid in the parent, like :func:`os.fork`; Python's own before/after-fork steps run around
    the system call. One clone replaces the fork + unshare + fork that a new pid namespace needs
    otherwise (each fork of a warm interpreter costs ~1.5 ms of CPU on this machine kind).
    The caller must be single-threaded.

    Raises:
        OSError: clone failed (EPERM without CAP_SYS_ADMIN, EAGAIN at the process limit).
    """
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = _pylibc.syscall(ctypes.c_long(_SYSCALLS["clone"][_ARCH]), ctypes.c_ulong(flags | SIGCHLD),
                          ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def isolation_layers() -> list[str]:
    """Every layer of the full isolation (the names used in ``degraded`` and ``disable_layers``)."""
    return ["cgroups", "landlock", "namespaces", "seccomp", "uid"]


def unshare(flags: int) -> None:
    """unshare(2) with ``CLONE_NEW*`` ``flags``. Raises OSError (EPERM without CAP_SYS_ADMIN)."""
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2). Raises OSError naming the target."""
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def bind_readonly(source: str, target: str) -> None:
    """Bind ``source`` onto ``target`` (recursively), then remount it read-only, nosuid and nodev."""
    mount(source, target, None, MS_BIND | MS_REC)
    mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def umount(target: str, flags: int = MNT_DETACH) -> None:
    """umount2(2), lazily by default."""
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root_here(new_root: str) -> None:
    """Make ``new_root`` (a mount point) the root of this mount namespace and drop the old root.

    Uses the ``pivot_root(".", ".")`` idiom (see pivot_root(2) NOTES), then detaches the old root,
    so no path leads back to the host file system. The cwd becomes ``/``.
    """
    os.chdir(new_root)
    _syscall("pivot_root", b".", b".")
    umount(".", MNT_DETACH)
    os.chdir("/")


def prctl(option: int, arg: int = 0) -> int:
    """prctl(2) with one argument."""
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                              ctypes.c_ulong(0)), f"prctl({option})")


def set_no_new_privs() -> None:
    """PR_SET_NO_NEW_PRIVS: execve can never grant privileges again (setuid bits, file capabilities)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


# ---------------------------------------------------------------- Landlock (landlock(7))

LL_FS = {
    "execute": 1 << 0, "write_file": 1 << 1, "read_file": 1 << 2, "read_dir": 1 << 3,
    "remove_dir": 1 << 4, "remove_file": 1 << 5, "make_char": 1 << 6, "make_dir": 1 << 7,
    "make_reg": 1 << 8, "make_sock": 1 << 9, "make_fifo": 1 << 10, "make_block": 1 << 11,
    "make_sym": 1 << 12, "refer": 1 << 13, "truncate": 1 << 14, "ioctl_dev": 1 << 15,
}
LL_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1, 2
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1, 2
_LL_CREATE_RULESET_VERSION = 1
_LL_RULE_PATH_BENEATH = 1


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 when Landlock is absent or disabled)."""
    ret = _libc.syscall(ctypes.c_long(_SYSCALLS["landlock_create_ruleset"][_ARCH]), None, ctypes.c_size_t(0),
                        ctypes.c_uint32(_LL_CREATE_RULESET_VERSION))
    return max(int(ret), 0)


def landlock_ruleset(read_paths: list[str], write_paths: list[str], write_files: list[str], abi: int) -> int:
    """A Landlock ruleset (a file descriptor) for the sandbox; :func:`landlock_enforce` applies it.

    Reads and execution are allowed beneath ``read_paths``; everything (create, remove, write,
    truncate) beneath ``write_paths``; plain reads and writes of the files in ``write_files`` (e.g.
    /dev/null). With ABI >= 4 every TCP bind and connect is denied; with ABI >= 6 signals and
    abstract unix sockets are scoped to the sandbox (it cannot signal its supervisor even as the
    same uid). Rules attach to inodes, so they hold for file systems mounted later on those paths.

    Raises:
        OSError: Landlock unsupported (ENOSYS/EOPNOTSUPP) or a path missing.
    """
    fs_all = LL_FS_BY_ABI.get(abi, (1 << 16) - 1)
    net = LL_NET_BIND_TCP | LL_NET_CONNECT_TCP if abi >= 4 else 0
    scoped = LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL if abi >= 6 else 0
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    attr = struct.pack("<QQQ", fs_all, net, scoped)[:size]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _syscall("landlock_create_ruleset", buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        read = LL_FS["execute"] | LL_FS["read_file"] | LL_FS["read_dir"]
        file_rw = LL_FS["read_file"] | LL_FS["write_file"] | LL_FS["truncate"]  # the only rights a file rule takes
        for paths, access in ((read_paths, read), (write_paths, fs_all), (write_files, file_rw)):
            for p in paths:
                fd = os.open(p, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = ctypes.create_string_buffer(struct.pack("<Qi", access & fs_all, fd), 12)
                    _syscall("landlock_add_rule", ctypes.c_int(ruleset), ctypes.c_int(_LL_RULE_PATH_BENEATH), rule,
                             ctypes.c_uint32(0))
                finally:
                    os.close(fd)
    except BaseException:
        os.close(ruleset)
        raise
    os.set_inheritable(ruleset, True)
    return ruleset


def landlock_enforce(ruleset: int) -> None:
    """Confine the calling thread (and every later child) with ``ruleset``, then close it.

    Needs no_new_privs (or CAP_SYS_ADMIN). Raises OSError.
    """
    try:
        _syscall("landlock_restrict_self", ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------- seccomp (libseccomp)

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl",
    "add_key", "request_key", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "vhangup", "quotactl", "lookup_dcookie", "mount_setattr",
    "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "personality",
)
"""System calls that fail with EPERM inside the sandbox (debugging other processes, mounts, new
namespaces, kernel objects a program has no business creating). ``clone3`` fails with ENOSYS so
that libc falls back to ``clone``, whose namespace flags the filter can inspect."""
AF_UNIX = 1
TIOCSTI = 0x5412


def seccomp_filter():
    """The sandbox's seccomp filter (a ``pyseccomp.SyscallFilter``); ``.load()`` it in the process to confine.

    Default allow; :data:`DENIED_SYSCALLS` give EPERM; ``socket``/``socketpair`` for any family but
    AF_UNIX give EACCES (no network even if a namespace were missing); ``clone`` with any
    ``CLONE_NEW*`` flag gives EPERM; ``ioctl(TIOCSTI)`` (terminal injection, CVE-2017-5226) gives EPERM;
    ``clone3`` gives ENOSYS. System calls of another architecture (x32, i386) kill the process
    (libseccomp's bad-arch action). Requires no_new_privs or CAP_SYS_ADMIN.

    Raises:
        ImportError: pyseccomp or libseccomp.so.2 is missing (``load()`` raises OSError when the
            kernel refuses the filter).
    """
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(eperm, name)
        except (ValueError, RuntimeError, OSError):
            pass  # not a system call on this architecture
    for name in ("socket", "socketpair"):
        f.add_rule(sc.ERRNO(errno.EACCES), name, sc.Arg(0, sc.NE, AF_UNIX))
    for bit in (1 << i for i in range(32) if NAMESPACE_FLAGS >> i & 1):
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    return f


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class SeccompProgram:
    """The filter of :func:`seccomp_filter` compiled once to classic BPF; :meth:`load` is one prctl.

    Compiling in the warm worker and loading the bytes in each run costs ~0.05 ms instead of the
    ~0.9 ms libseccomp spends generating the program in every child.
    """

    def __init__(self) -> None:
        import tempfile

        with tempfile.TemporaryFile() as f:
            seccomp_filter().export_bpf(f)
            f.seek(0)
            code = f.read()
        if not code or len(code) % 8:
            raise OSError(errno.EINVAL, "libseccomp exported an empty or torn BPF program")
        self._buf = ctypes.create_string_buffer(code, len(code))
        self._prog = _SockFprog(len(code) // 8, ctypes.cast(self._buf, ctypes.c_void_p))

    def load(self) -> None:
        """Install the filter on the calling thread (no_new_privs must be set). Raises OSError."""
        _check(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                           ctypes.byref(self._prog), ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp")


# ---------------------------------------------------------------- probe


@dataclass
class Capabilities:
    """What this host lets the sandbox do, found once at start-up by :func:`probe`."""

    root: bool = False
    namespaces: bool = False
    """mount, pid, net, ipc and uts namespaces can be created."""
    cgroup: str | None = None
    """``"v1"`` or ``"v2"`` when a writable cgroup hierarchy with memory and pids controllers exists."""
    landlock_abi: int = 0
    seccomp: bool = False
    problems: dict[str, str] = field(default_factory=dict)
    """Layer name -> why it is unavailable."""


def _child_ok(fn) -> str | None:
    """Run ``fn`` in a forked child; None when it returned normally, else the error text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fn()
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, f"{type(e).__name__}: {e}".encode()[:500])
            os._exit(1)
    os.close(w)
    msg = b""
    while chunk := os.read(r, 4096):
        msg += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else (msg.decode(errors="replace") or f"status {status}")


def probe(cgroup_root: str = "/sys/fs/cgroup") -> Capabilities:
    """Test every isolation layer once, each in a throw-away child process.

    Never raises; unavailable layers are listed in ``Capabilities.problems`` with the reason.
    """
    from sandbox_service.cgroups import detect_cgroup

    caps = Capabilities(root=os.geteuid() == 0)
    if not caps.root:
        caps.problems["uid"] = "the service is not root: code cannot run as a per-slot unprivileged uid"
    err = _child_ok(lambda: unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS))
    caps.namespaces = err is None
    if err:
        caps.problems["namespaces"] = f"unshare(mount, pid, net, ipc, uts) failed: {err}"
    caps.cgroup, why = detect_cgroup(cgroup_root)
    if caps.cgroup is None:
        caps.problems["cgroups"] = why
    caps.landlock_abi = landlock_abi()
    if caps.landlock_abi < 1:
        caps.problems["landlock"] = "the kernel has no Landlock (needs Linux 5.13+ with lsm=landlock)"
    else:
        err = _child_ok(lambda: (set_no_new_privs(), landlock_enforce(landlock_ruleset(["/"], [], [], caps.landlock_abi))))
        if err:
            caps.problems["landlock"] = err
            caps.landlock_abi = 0
    err = _child_ok(lambda: (set_no_new_privs(), SeccompProgram().load()))
    caps.seccomp = err is None
    if err:
        caps.problems["seccomp"] = f"{err} (pip install pyseccomp; apt install libseccomp2)"
    return caps
