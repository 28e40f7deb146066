"""A worker's state fixed for its life: the slot, its uid and isolation layers, the slot cgroup, the
seccomp program and the prepared read-only root (set up once, before any run)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

from sandbox_service import harness, isolation
from sandbox_service.cgroups import SlotCgroup


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
