"""The service side of the sandbox: a pool of warm workers, retries, recycling and a circuit breaker.

Each slot is one :mod:`sandbox_service.worker` process, talked to over its stdin/stdout with
length-prefixed orjson frames. An execution takes an idle worker, sends the request, and waits
for the result with a backstop deadline (the run's own limit + :data:`BACKSTOP_SLACK_S`).

Environment failures (the worker died or hung, a torn frame, set-up failure inside the sandbox)
are never the program's fault: the worker is killed and replaced, and the execution is retried
on another worker up to ``retries`` times, then reported as ``infra_error``. A circuit breaker
watches the share of the last ``breaker_window`` executions that ended so; while it is open the
service refuses new work (HTTP 503) and says so on ``/healthz``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import shutil
import signal
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import get_args

import orjson

from sandbox_service.cgroups import SlotCgroup, slot_cgroup_names
from sandbox_service.config import SandboxConfig
from sandbox_service.isolation import Capabilities
from sandbox_service.isolation import isolation_layers
from sandbox_service.metrics import PoolReading, SandboxMetrics
from sandbox_service.schemas import ExecuteRequest, ExecuteResult, Status, TestResult
from sandbox_service.uids import UidClaim

log = logging.getLogger("sandbox.pool")

BACKSTOP_SLACK_S = 10.0
"""Seconds past a run's own wall limit after which its worker is considered hung and killed."""
_PKG_ROOT = str(Path(__file__).resolve().parents[1])
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


def _records(channel: bytes, token: str) -> list[dict]:
    """The JSON-object lines of the result channel that carry ``token`` (others are ignored)."""
    out = []
    for line in channel.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("token") == token:
            out.append(rec)
    return out


def harness_started(channel: bytes, token: str) -> bool:
    """Whether the harness announced itself on the result channel (its first record, with the run's token)."""
    recs = _records(channel, token)
    return bool(recs) and recs[0].get("started") is True


def parse_test_results(names: list[str], channel: bytes, token: str, run_status: str) -> list[TestResult]:
    """Per-test results from the harness's private channel (JSON lines); lines without ``token`` are ignored.

    A test with no line is ``timeout`` when the run timed out, else ``not_run`` (the program ended
    the process before the harness could report it).
    """
    got: dict[int, dict] = {}
    for rec in _records(channel, token):
        i = rec.get("i")
        if isinstance(i, int) and 0 <= i < len(names) and i not in got:
            got[i] = rec
    missing = "timeout" if run_status == "timeout" else "not_run"
    out = []
    for i, name in enumerate(names):
        rec = got.get(i)
        if rec is None or rec.get("status") not in ("passed", "failed", "error"):
            out.append(TestResult(name=name, status=missing, message=f"no result reported (run status {run_status})"))
        else:
            secs = rec.get("seconds")
            out.append(TestResult(name=name, status=rec["status"], message=str(rec.get("message", ""))[:4000],
                                  seconds=float(secs) if isinstance(secs, (int, float)) else None))
    return out


def remove_worker_leftovers(name: str, cgroup: str | None) -> None:
    """Kill anything left in worker ``name``'s slot cgroups and remove them, and its scratch directory."""
    if cgroup:
        SlotCgroup(cgroup, name).remove()
    for d in Path(tempfile.gettempdir()).glob(f"flywheel-sbx-{name}-*"):
        shutil.rmtree(d, ignore_errors=True)


def remove_stale_leftovers(cgroup: str | None) -> int:
    """Remove the slot cgroups and scratch directories of sandbox services that are no longer running
    (their names start with the service's pid); returns how many workers' leftovers were removed."""
    names: set[str] = set()
    if cgroup:
        names |= set(slot_cgroup_names(cgroup))
    names |= {d.name[len("flywheel-sbx-"):].rsplit("-", 1)[0] for d in Path(tempfile.gettempdir()).glob("flywheel-sbx-*")}
    removed = 0
    for name in names:
        pid = name.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove_worker_leftovers(name, cgroup)
            removed += 1
    return removed


class WorkerFailure(Exception):
    """The worker process failed (died, hung, or answered a torn frame); the attempt is an environment failure."""


class WorkerHandle:
    """One worker process and its pipes."""

    def __init__(self, index: int, cfg: SandboxConfig, layers: list[str], caps: Capabilities,
                 cgroup: str | None, uid: int | None = None) -> None:
        self.index, self.uid = index, uid
        self.cfg, self.layers, self.caps, self.cgroup = cfg, layers, caps, cgroup
        self.name = f"{os.getpid()}-slot{index}-{uuid.uuid4().hex[:6]}"
        self.proc: asyncio.subprocess.Process | None = None
        self.runs = 0

    @property
    def alive(self) -> bool:
        """The worker process is running."""
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Spawn the worker and wait for its ready frame. Raises WorkerFailure with the worker's reason."""
        python = self.cfg.python or sys.executable
        args = [python, "-s", "-B", "-m", "sandbox_service.worker", "--slot", self.name, "--layers", ",".join(self.layers),
                "--landlock-abi", str(self.caps.landlock_abi), "--python", python, "--cpu-cores", str(self.cfg.cpu_cores)]
        if "uid" in self.layers and self.uid is not None:
            args += ["--uid", str(self.uid)]
        if self.cgroup:
            args += ["--cgroup", self.cgroup]
        env = {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "PYTHONPATH": _PKG_ROOT}  # nothing of the service's own
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd="/",
                start_new_session=True, limit=2**26)
        except OSError as e:
            raise WorkerFailure(f"cannot start worker {self.name} with {python}: {e}") from None
        try:
            hello = await asyncio.wait_for(self._read(), self.cfg.worker_start_timeout_s)
        except (WorkerFailure, asyncio.TimeoutError) as e:
            self.kill()
            raise WorkerFailure(f"worker {self.name} did not start: {e!r}") from None
        if not hello.get("ready"):
            self.kill()
            raise WorkerFailure(hello.get("error", f"worker {self.name} did not start"))

    async def _read(self) -> dict:
        """One frame; its raw parts (if any) come back as a list of bytes under ``"_parts"``."""
        assert self.proc and self.proc.stdout
        try:
            head = await self.proc.stdout.readexactly(4)
            (n,) = struct.unpack(">I", head)
            frame = orjson.loads(await self.proc.stdout.readexactly(n))
            if not isinstance(frame, dict):
                raise ValueError("frame is not an object")
            frame["_parts"] = [await self.proc.stdout.readexactly(k) for k in frame.get("parts", [])]
            return frame
        except (asyncio.IncompleteReadError, orjson.JSONDecodeError, ValueError, TypeError, ConnectionError) as e:
            raise WorkerFailure(f"worker {self.name} closed its pipe or sent a torn frame: {e!r}") from None

    async def request(self, req: dict, timeout_s: float) -> dict:
        """Send one request frame, wait for the result frame. Raises WorkerFailure (the worker is then unusable)."""
        if not self.alive:
            raise WorkerFailure(f"worker {self.name} is not running")
        assert self.proc and self.proc.stdin
        body = orjson.dumps(req)
        try:
            self.proc.stdin.write(struct.pack(">I", len(body)) + body)
            await self.proc.stdin.drain()
            return await asyncio.wait_for(self._read(), timeout_s)
        except (ConnectionError, BrokenPipeError) as e:
            raise WorkerFailure(f"worker {self.name} pipe broke: {e!r}") from None
        except asyncio.TimeoutError:
            raise WorkerFailure(f"worker {self.name} did not answer within {timeout_s:.1f} s") from None
        finally:
            self.runs += 1

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (its supervisor and run die with it)."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to stop (close its request pipe); SIGKILL it after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.stdin and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.kill()
            await self.proc.wait()


class CircuitBreaker:
    """Opens when environment failures reach ``ratio`` of the last ``window`` executions.

    Counted once per execution (its final outcome after retries), so one request that keeps failing
    weighs one, not ``1 + retries``. While open, every request is refused; after ``cooldown_s`` the
    pool itself runs a canary execution (the trial), never a caller's request, so nobody can hold
    the breaker half-open with a slow program.
    """

    def __init__(self, window: int, ratio: float, cooldown_s: float) -> None:
        self.window = collections.deque(maxlen=window)
        self.ratio, self.cooldown_s = ratio, cooldown_s
        self.state = "closed"
        self.opened_at = 0.0
        self.opened_count = 0

    def allow(self) -> bool:
        """Whether a caller's execution may start now."""
        return self.state == "closed"

    def trial_due(self) -> bool:
        """Whether the cool-down is over and a canary should test the environment (moves to half_open)."""
        if self.state == "open" and time.monotonic() - self.opened_at >= self.cooldown_s:
            self.state = "half_open"
            return True
        return False

    def trial_result(self, ok: bool) -> None:
        """Close after a good canary; re-open (a new cool-down) after a bad one."""
        if ok:
            self.state = "closed"
            self.window.clear()
        else:
            self._open()

    def record(self, env_failure: bool) -> None:
        """Count one execution's final outcome."""
        if self.state != "closed":
            return
        self.window.append(env_failure)
        if len(self.window) == self.window.maxlen and sum(self.window) >= self.ratio * len(self.window):
            self._open()

    def _open(self) -> None:
        self.state, self.opened_at = "open", time.monotonic()
        self.opened_count += 1
        log.error("sandbox circuit breaker OPEN: %d of the last %d executions failed in the environment",
                  sum(self.window), len(self.window))

    def snapshot(self) -> dict:
        """State, recent environment failures over the window, and how often it opened (for /healthz)."""
        return {"state": self.state, "recent_failures": sum(self.window), "window": len(self.window),
                "times_opened": self.opened_count}


class Overloaded(Exception):
    """No execution can start now (queue full, breaker open, shutting down); maps to HTTP 503."""


class Pool:
    """Warm workers plus the retry, recycling and breaker policy (one per service process)."""

    def __init__(self, cfg: SandboxConfig, caps: Capabilities) -> None:
        self.cfg, self.caps = cfg, caps
        available = set(isolation_layers()) - set(caps.problems)
        if cfg.uid_base is None:
            available.discard("uid")
        self.layers = sorted(available - set(cfg.disable_layers))
        self.degraded = sorted(set(isolation_layers()) - set(self.layers))
        self.network_isolated = "namespaces" in self.layers or "seccomp" in self.layers
        self.cgroup = caps.cgroup if "cgroups" in self.layers else None
        """The cgroup hierarchy the workers use (``v1``/``v2``), or None when that layer is off."""
        self.idle: asyncio.Queue[WorkerHandle] = asyncio.Queue()
        self.workers: dict[int, WorkerHandle] = {}
        self.breaker = CircuitBreaker(cfg.breaker_window, cfg.breaker_failure_ratio, cfg.breaker_cooldown_s)
        self.waiting = 0
        self.running = 0
        self.closing = False
        self.counters = collections.Counter()
        self.runs: dict[str, int] = {s: 0 for s in get_args(Status)}
        self.metrics = SandboxMetrics(self._reading)
        """Prometheus families (``GET /metrics``): the latency histogram, and this pool's state read when scraped."""
        self._tasks: set[asyncio.Task] = set()
        self._cleanups: set[asyncio.Task] = set()
        self.uids: UidClaim | None = None
        """The slots' uids, claimed at :meth:`start` (``None`` without the ``uid`` layer)."""
        self._canary_wire = self._wire(ExecuteRequest(code="pass", timeout_s=5.0, memory_mb=64, max_processes=4,
                                                      disk_mb=1, output_limit_bytes=1024), "canary")

    async def start(self) -> None:
        """Start every worker. Raises RuntimeError when none starts (the reason of the first failure)."""
        if "uid" in self.layers:
            self.uids = UidClaim(self.cfg.uid_base, self.cfg.max_concurrency)
        stale = await asyncio.to_thread(remove_stale_leftovers, self.cgroup)
        if stale:
            log.info("removed the leftovers of %d workers of sandbox services that are gone", stale)
        results = await asyncio.gather(*(self._spawn(i) for i in range(self.cfg.max_concurrency)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == len(results):
            raise RuntimeError(f"sandbox: no worker started: {errors[0]}")
        for e in errors:
            log.error("sandbox worker failed to start: %s", e)
            self._replace_later(None)
        self._spawn_task(self._breaker_loop())
        if self.cfg.health_check_interval_s > 0:
            self._spawn_task(self._health_loop())

    async def _health_loop(self) -> None:
        """Every ``health_check_interval_s``, run a canary on each idle worker; replace the ones that fail."""
        while not self.closing:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            for _ in range(self.idle.qsize()):
                if self.closing:
                    return
                try:
                    w = self.idle.get_nowait()
                except asyncio.QueueEmpty:
                    break
                self.counters["health_checks"] += 1
                if not await self._canary(w):
                    self.counters["health_check_failures"] += 1
                    log.error("sandbox worker %s failed its health check; replaced", w.name)

    async def _spawn(self, index: int) -> WorkerHandle:
        w = WorkerHandle(index, self.cfg, self.layers, self.caps, self.cgroup,
                         self.uids.uids[index] if self.uids else None)
        try:
            await w.start()
        except WorkerFailure:
            self._cleanups.add(asyncio.create_task(self._cleanup(w)))
            raise
        self.workers[index] = w
        self.idle.put_nowait(w)
        self.counters["workers_started"] += 1
        return w

    def _replace_later(self, dead: WorkerHandle | None) -> None:
        """Kill ``dead`` (if any) and start a replacement for its slot in the background."""
        index = dead.index if dead else next(i for i in range(self.cfg.max_concurrency) if i not in self.workers)
        if dead is not None:
            dead.kill()
            self.workers.pop(index, None)
            self._cleanups.add(asyncio.create_task(self._cleanup(dead)))

        async def respawn() -> None:
            for delay in (0.0, 0.5, 2.0, 5.0, 10.0):
                if self.closing:
                    return
                await asyncio.sleep(delay)
                try:
                    await self._spawn(index)
                    return
                except WorkerFailure as e:
                    log.error("sandbox worker %d restart failed: %s", index, e)
            self.counters["worker_restart_gave_up"] += 1

        self._spawn_task(respawn())

    async def _acquire(self) -> WorkerHandle:
        while True:
            w = await self.idle.get()
            if w.alive:
                return w
            self.counters["workers_found_dead"] += 1
            self._replace_later(w)

    def admit(self) -> None:
        """Raise Overloaded when a new execution must be refused now."""
        if self.closing:
            raise Overloaded("sandbox is shutting down")
        if self.idle.empty() and self.waiting >= self.cfg.max_queued:
            raise Overloaded(f"sandbox overloaded: {self.waiting} executions already waiting")
        if not self.breaker.allow():
            raise Overloaded("sandbox circuit breaker is open: the execution environment is failing")

    async def execute(self, req: ExecuteRequest, run_id: str | None = None, session: dict | None = None) -> ExecuteResult:
        """Run ``req`` on a warm worker, retrying environment failures; call :meth:`admit` first. ``session``:
        the service's description of a session workspace to mount on /work (:meth:`sandbox_service.sessions.Session.wire`).

        Returns the result; ``infra_error`` only after ``1 + retries`` failed attempts.
        Raises asyncio.CancelledError when cancelled (the worker in use is killed and replaced).
        """
        run_id = run_id or uuid.uuid4().hex
        token = secrets.token_hex(16)
        wire = self._wire(req, token)
        if session is not None:
            wire["session"] = session
        backstop = wire["limits"]["timeout_s"] + BACKSTOP_SLACK_S
        last_error = ""
        t0 = time.monotonic()
        attempt = 0
        for attempt in range(1, self.cfg.retries + 2):
            self.waiting += 1
            try:
                w = await self._acquire()
            finally:
                self.waiting -= 1
            self.running += 1
            try:
                raw = await w.request(wire, backstop)
            except WorkerFailure as e:
                raw = {"status": "infra_error", "error": str(e), "_parts": []}
                self._replace_later(w)
                w = None
            except BaseException:
                self._replace_later(w)
                raise
            finally:
                self.running -= 1
            if (req.tests is not None and raw.get("status") in ("ok", "runtime_error", "killed")
                    and not harness_started(raw["_parts"][2], token)):
                # the harness never ran (the run died before any user code): the environment's fault
                raw = {"status": "infra_error", "error": "the test harness did not start", "_parts": raw["_parts"]}
            env_failure = raw.get("status") == "infra_error"
            if w is not None:
                if env_failure:  # never reuse a worker whose environment just failed
                    self._replace_later(w)
                elif w.runs >= self.cfg.recycle_after_runs:
                    self.counters["workers_recycled"] += 1
                    self._recycle(w)
                else:
                    self.idle.put_nowait(w)
            self.counters["attempts"] += 1
            if not env_failure:
                break
            self.counters["environment_failures"] += 1
            parts = raw.get("_parts") or []
            detail = parts[3].decode("utf-8", "replace") if len(parts) > 3 and parts[3] else ""
            last_error = f"{raw.get('error', 'environment failure')}{': ' + detail if detail else ''}"
            log.warning("sandbox attempt %d of run %s failed in the environment: %s", attempt, run_id, last_error)
        result = self._result(req, raw, token, run_id, attempt, last_error)
        self.breaker.record(result.status == "infra_error")
        self._count(result, time.monotonic() - t0, req.language)
        return result

    async def _canary(self, w: WorkerHandle) -> bool:
        """One trivial execution on the idle worker ``w``: True when it ran ``ok`` (``w`` goes back to
        the idle queue), else False (``w`` is replaced)."""
        try:
            ok = (await w.request(self._canary_wire, 5.0 + BACKSTOP_SLACK_S)).get("status") == "ok"
        except WorkerFailure:
            ok = False
        if ok:
            self.idle.put_nowait(w)
        else:
            self._replace_later(w)
        return ok

    async def _breaker_loop(self) -> None:
        """Run the breaker's trial when its cool-down ends, whether or not requests arrive."""
        while not self.closing:
            await asyncio.sleep(min(0.5, self.cfg.breaker_cooldown_s))
            if self.breaker.trial_due():
                await self._breaker_trial()

    async def _breaker_trial(self) -> None:
        ok = await self._canary(await self._acquire())
        self.counters["breaker_trials"] += 1
        self.breaker.trial_result(ok)
        log.warning("sandbox circuit breaker trial %s: breaker %s", "passed" if ok else "failed", self.breaker.state)

    def _spawn_task(self, coro) -> None:
        """Run ``coro`` in the background, cancelled by :meth:`close`."""
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _result(self, req: ExecuteRequest, raw: dict, token: str, run_id: str, attempts: int,
                last_error: str) -> ExecuteResult:
        common = {"run_id": run_id, "attempts": attempts, "network_isolated": self.network_isolated,
                  "degraded": self.degraded}
        if raw.get("status") == "infra_error":
            return ExecuteResult(status="infra_error", exit_code=None, stdout="", wall_s=raw.get("wall_s", 0.0),
                                 stderr=f"sandbox: the environment failed {attempts} times; last: {last_error}",
                                 **common)
        out, err, results, _ = raw["_parts"]
        fields = {k: raw.get(k) for k in ("status", "exit_code", "wall_s", "cpu_s", "peak_memory_bytes")}
        res = ExecuteResult(stdout=out.decode("utf-8", "replace"),
                            stderr=raw["message"] if "message" in raw else err.decode("utf-8", "replace"),
                            stdout_truncated=bool(raw.get("stdout_truncated")),
                            stderr_truncated=bool(raw.get("stderr_truncated")), **fields, **common)
        if req.tests is not None:
            tests = parse_test_results([t.name for t in req.tests], results, token, res.status)
            res.tests = tests
            res.tests_passed = sum(t.status == "passed" for t in tests)
            res.tests_total = len(tests)
        return res

    async def _cleanup(self, w: WorkerHandle) -> None:
        """Remove what a killed worker left on the host: its cgroups and its scratch directory."""
        if w.proc is not None:
            try:
                await asyncio.wait_for(w.proc.wait(), 10)
            except asyncio.TimeoutError:
                pass
        await asyncio.to_thread(remove_worker_leftovers, w.name, self.cgroup)

    def _recycle(self, w: WorkerHandle) -> None:
        self.workers.pop(w.index, None)

        async def replace() -> None:
            await w.close()
            if not self.closing:
                try:
                    await self._spawn(w.index)
                except WorkerFailure as e:
                    log.error("sandbox worker %d could not be recycled: %s", w.index, e)
                    self._replace_later(None)

        self._spawn_task(replace())

    def _wire(self, req: ExecuteRequest, token: str) -> dict:
        c = self.cfg
        timeout = req.timeout_s if req.timeout_s is not None else c.default_timeout_s
        return {
            "token": token, "language": req.language, "code": req.code, "stdin": req.stdin, "files": req.files,
            "tests": [t.model_dump() for t in req.tests] if req.tests is not None else None,
            "entry_point": req.entry_point, "fresh_interpreter": req.fresh_interpreter,
            "limits": {
                "timeout_s": timeout,
                "cpu_time_s": req.cpu_time_s if req.cpu_time_s is not None else timeout,
                "memory_mb": req.memory_mb if req.memory_mb is not None else c.default_memory_mb,
                "max_processes": req.max_processes if req.max_processes is not None else c.default_max_processes,
                "disk_mb": req.disk_mb if req.disk_mb is not None else c.default_disk_mb,
                "output_limit_bytes": (req.output_limit_bytes if req.output_limit_bytes is not None
                                       else c.default_output_limit_bytes),
            },
        }

    def _count(self, r: ExecuteResult, seconds: float, language: str) -> None:
        self.runs[r.status] += 1
        self.metrics.execution_seconds.labels(language).observe(seconds)

    def _reading(self) -> PoolReading:
        """This pool's state for a metrics scrape (:class:`sandbox_service.metrics.PoolCollector`)."""
        return PoolReading(self.runs, self.counters, int(self.breaker.state != "closed"), self.running,
                           self.idle.qsize(), self.waiting, sum(w.alive for w in list(self.workers.values())),
                           self.cfg.max_concurrency)

    def health(self) -> dict:
        """State for ``/healthz``."""
        alive = sum(w.alive for w in self.workers.values())
        ok = self.breaker.state == "closed" and alive > 0 and not self.closing
        return {
            "status": ("ok" if not self.degraded else "degraded") if ok else "unavailable",
            "layers": self.layers, "degraded": self.degraded, "network_isolated": self.network_isolated,
            "cgroup": self.caps.cgroup, "landlock_abi": self.caps.landlock_abi,
            "workers": {"configured": self.cfg.max_concurrency, "alive": alive, "idle": self.idle.qsize(),
                        "pids": sorted(w.proc.pid for w in self.workers.values() if w.alive and w.proc)},
            "breaker": self.breaker.snapshot(), "runs": dict(self.runs), "running": self.running,
            "waiting": self.waiting, "counters": dict(self.counters),
        }

    async def close(self) -> None:
        """Stop every worker (and the runs in them)."""
        self.closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._cleanups, return_exceptions=True)  # killed workers' leftovers
        workers = list(self.workers.values())
        await asyncio.gather(*(w.close(timeout_s=2.0) for w in workers), return_exceptions=True)
        for w in workers:
            w.kill()
        for w in workers:
            if w.proc is not None:
                await w.proc.wait()
            await asyncio.to_thread(remove_worker_leftovers, w.name, self.cgroup)
        if self.uids is not None:
            self.uids.release()
