"""One cgroup per sandbox slot: memory, pids and CPU quotas, peak memory, OOM kills, and a kill-all sweep.

Both hierarchies are handled: cgroup v1 (one mount per controller, e.g. ``/sys/fs/cgroup/memory``;
what this machine kind has) and v2 (one unified mount with ``cgroup.controllers``). Files used:

====================  ===============================  ==============================
                      v1                               v2
====================  ===============================  ==============================
memory limit (bytes)  memory.limit_in_bytes (+memsw)   memory.max (+ memory.swap.max 0)
peak memory (bytes)   memory.max_usage_in_bytes        memory.peak
OOM kills (count)     memory.oom_control ``oom_kill``  memory.events ``oom_kill``
processes             pids.max                         pids.max
CPU quota             cpu.cfs_quota_us / period        cpu.max
CPU time (ns)         cpuacct.usage                    cpu.stat ``usage_usec``
====================  ===============================  ==============================
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PARENT = "flywheel-sandbox"
"""Name of the cgroup that holds every slot's cgroup."""
_CPU_PERIOD_US = 100_000


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def detect_cgroup(root: str = "/sys/fs/cgroup") -> tuple[str | None, str]:
    """Which writable cgroup hierarchy has memory and pids controllers: ``("v1"|"v2", "")`` or ``(None, why)``."""
    r = Path(root)
    try:
        if (r / "cgroup.controllers").exists():
            ctrls = _read(r / "cgroup.controllers").split()
            if not {"memory", "pids"} <= set(ctrls):
                return None, f"cgroup v2 at {root} lacks memory/pids controllers (has {ctrls})"
            probe = r / f"{PARENT}-probe-{os.getpid()}"
            probe.mkdir(exist_ok=True)
            probe.rmdir()
            return "v2", ""
        if (r / "memory" / "memory.limit_in_bytes").exists() and (r / "pids" / "cgroup.procs").exists():
            for ctrl in ("memory", "pids"):
                probe = r / ctrl / f"{PARENT}-probe-{os.getpid()}"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            return "v1", ""
        return None, f"no cgroup hierarchy with memory and pids controllers under {root}"
    except OSError as e:
        return None, f"cgroups under {root} are not writable: {e}"


def slot_cgroup_names(version: str, root: str = "/sys/fs/cgroup") -> list[str]:
    """Names of the slot cgroups that exist now (any service's)."""
    r = Path(root)
    parents = [r / c / PARENT for c in ("memory", "pids", "cpu", "cpuacct")] if version == "v1" else [r / PARENT]
    names: set[str] = set()
    for p in parents:
        if p.is_dir():
            names |= {d.name for d in p.iterdir() if d.is_dir()}
    return sorted(names)


class SlotCgroup:
    """The cgroup(s) of one sandbox slot; create with :meth:`create`, remove with :meth:`remove`.

    Args:
        version: ``"v1"`` or ``"v2"`` (from :func:`detect_cgroup`).
        name: slot name, unique per service process (e.g. ``"1234-slot0"``).
        root: mount point of the cgroup file systems.
    """

    def __init__(self, version: str, name: str, root: str = "/sys/fs/cgroup") -> None:
        self.version = version
        r = Path(root)
        if version == "v1":
            self.dirs = {c: r / c / PARENT / name for c in ("memory", "pids", "cpu", "cpuacct")
                         if (r / c / "cgroup.procs").exists()}
        else:
            self.dirs = {"unified": r / PARENT / name}
        self._oom_before = 0
        self._cpu_before: int | None = None
        self._oom_after: int | None = None
        self.base_bytes = 0
        """Memory charged to the slot before the run (read by :meth:`reset_counters`): pages of session files
        that earlier runs wrote on the sessions' tmpfs stay charged to the slot that wrote them, so a run's
        limit and peak are counted on top of them."""

    def _dir(self, ctrl: str) -> Path | None:
        return self.dirs.get(ctrl if self.version == "v1" else "unified")

    def create(self) -> None:
        """Create the slot's cgroups (and the parent). Raises OSError when the hierarchy is not writable."""
        for d in self.dirs.values():
            if self.version == "v2" and not d.parent.exists():
                d.parent.mkdir(exist_ok=True)
                try:
                    _write(d.parent / "cgroup.subtree_control", "+memory +pids +cpu")
                except OSError:
                    _write(d.parent / "cgroup.subtree_control", "+memory +pids")
            d.mkdir(parents=True, exist_ok=True)

    def reset_counters(self) -> None:
        """Start a run's accounting: reset the peak memory (and CPU time on v1), remember the OOM and CPU counters."""
        if self.version == "v1":
            _write(self.dirs["memory"] / "memory.max_usage_in_bytes", "0")
            if "cpuacct" in self.dirs:
                _write(self.dirs["cpuacct"] / "cpuacct.usage", "0")
                self._cpu_before = 0
            else:
                self._cpu_before = None
        else:
            if (self.dirs["unified"] / "memory.peak").exists():
                try:
                    _write(self.dirs["unified"] / "memory.peak", "0")  # Linux 6.12+: resets the peak for this writer
                except OSError:
                    pass
            self._cpu_before = self._cpu_ns_raw()
        self.base_bytes = self.usage_bytes()
        if self._oom_after is None:  # the counter is cumulative: the last run's reading is this run's start
            self._oom_after = self.oom_kills()
        self._oom_before = self._oom_after

    def set_limits(self, memory_bytes: int, max_pids: int) -> None:
        """Set a run's memory (bytes, no swap beyond it) and process limits. Raises OSError."""
        if self.version == "v1":
            mem = self.dirs["memory"]
            files = ["memory.limit_in_bytes"]
            if (mem / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping past the limit
                files.append("memory.memsw.limit_in_bytes")
            try:
                for f in files:  # lowering: memory first (memsw must stay >= memory)
                    _write(mem / f, str(memory_bytes))
            except OSError:
                for f in reversed(files):  # raising: memsw first
                    _write(mem / f, str(memory_bytes))
            _write(self.dirs["pids"] / "pids.max", str(max_pids))
        else:
            d = self.dirs["unified"]
            _write(d / "memory.max", str(memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(max_pids))

    def set_cpu_quota(self, cpu_cores: float) -> None:
        """Limit the slot to ``cpu_cores`` cores (cgroup cpu controller; once per worker). Raises OSError."""
        quota = int(cpu_cores * _CPU_PERIOD_US)
        if self.version == "v1":
            if "cpu" in self.dirs:
                _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
                _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
        elif (self.dirs["unified"] / "cpu.max").exists():
            _write(self.dirs["unified"] / "cpu.max", f"{quota} {_CPU_PERIOD_US}")

    def attach(self, pid: int = 0, only: tuple[str, ...] | None = None) -> None:
        """Move process ``pid`` (0 = the caller) into the slot's controllers (v1: ``only`` those named;
        v2 has a single hierarchy, where it joins on the first call that names ``memory``). Raises OSError."""
        for ctrl, d in self.dirs.items():
            if self.version == "v1" and only is not None and ctrl not in only:
                continue
            if self.version == "v2" and only is not None and "memory" not in only:
                continue
            _write(d / "cgroup.procs", str(pid or os.getpid()))

    def pids(self) -> list[int]:
        """Processes now in the slot."""
        d = self._dir("pids")
        try:
            return [int(x) for x in _read(d / "cgroup.procs").split()] if d else []
        except OSError:
            return []

    def kill_all(self, timeout_s: float = 2.0, keep: int | None = None) -> bool:
        """SIGKILL every process in the slot but ``keep`` (a pid) until none is left; True when done within ``timeout_s``."""
        d = self._dir("pids")
        if keep is None and self.version == "v2" and d is not None and (d / "cgroup.kill").exists():
            try:
                _write(d / "cgroup.kill", "1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while True:
            procs = [p for p in self.pids() if p != keep]
            if not procs:
                return True
            for p in procs:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def usage_bytes(self) -> int:
        """Memory charged to the slot now (bytes; 0 when unknown)."""
        try:
            if self.version == "v1":
                return int(_read(self.dirs["memory"] / "memory.usage_in_bytes"))
            return int(_read(self.dirs["unified"] / "memory.current"))
        except (OSError, ValueError, KeyError):
            return 0

    def peak_memory_bytes(self) -> int | None:
        """Largest memory use of the slot since :meth:`reset_counters` (bytes, less what was charged before it),
        or None when unknown."""
        try:
            if self.version == "v1":
                peak = int(_read(self.dirs["memory"] / "memory.max_usage_in_bytes"))
            else:
                p = self.dirs["unified"] / "memory.peak"
                if not p.exists():
                    return None
                peak = int(_read(p))
        except (OSError, ValueError):
            return None
        return max(0, peak - self.base_bytes)

    def oom_kills(self) -> int:
        """Cumulative OOM kills in the slot (the kernel's ``oom_kill`` counter)."""
        f = (self.dirs["memory"] / "memory.oom_control") if self.version == "v1" else self.dirs["unified"] / "memory.events"
        try:
            for line in _read(f).splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_killed(self) -> bool:
        """Whether the OOM killer fired in the slot since :meth:`reset_counters` (call once per run)."""
        self._oom_after = self.oom_kills()
        return self._oom_after > self._oom_before

    def _cpu_ns_raw(self) -> int | None:
        try:
            if self.version == "v1":
                return int(_read(self.dirs["cpuacct"] / "cpuacct.usage")) if "cpuacct" in self.dirs else None
            for line in _read(self.dirs["unified"] / "cpu.stat").splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) * 1000
        except (OSError, ValueError):
            pass
        return None

    def cpu_seconds(self) -> float | None:
        """CPU time used by all processes of the slot since :meth:`reset_counters` (seconds), or None."""
        now = self._cpu_ns_raw()
        if now is None or self._cpu_before is None:
            return None
        return max(0, now - self._cpu_before) / 1e9

    def remove(self) -> None:
        """Kill what is left and remove the slot's cgroups (errors ignored). A caller inside the slot
        (the worker itself) first moves back to the hierarchy's root."""
        me = str(os.getpid())
        for d in self.dirs.values():
            try:
                if me in _read(d / "cgroup.procs").split():
                    _write(d.parent.parent / "cgroup.procs", me)
            except OSError:
                pass
        self.kill_all()
        for d in self.dirs.values():
            try:
                d.rmdir()
            except OSError:
                pass
