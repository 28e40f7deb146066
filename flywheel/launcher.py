"""Starting, supervising and stopping a local Flywheel system: the embedded broker plus five services.

Each service is a separate process (``python -m <service>``) in its own session, started with the
same YAML config and environment overrides, logging under ``<run dir>/logs``. Everything is stopped by pid.

Supervision (:meth:`LocalSystem.check`, called in a poll loop by ``flywheel run``/``up``): a dead process is
reported with its pid, why it died (exit code, or the signal's name) and its last log lines. The broker is
checked first: a dead broker is restarted at once on the same port (memory storage: it comes back empty),
its topics are re-created, and the scheduler is told (``POST /v1/system/broker-restarted``) so it re-issues
every in-flight group at once. A dead service is respawned after an exponential backoff
(:class:`flywheel.supervision.RestartPolicy`), scheduled rather than slept, so one crash-looping service never
holds up the others. Restarts are counted per process in a sliding window; crashes of services while, or just
after, the broker was down are the broker's fault and are not counted against them.

Hygiene: the run directory is 0700 and every child starts with umask 0o077 (its files are 0600); the auth
token (``<run dir>/auth_token``, 0600) exists before any service starts; services get only the variables of
:data:`~flywheel.service_env.SERVICE_ENV_ALLOW` / :data:`~flywheel.service_env.SERVICE_ENV_PREFIXES` from the
caller's environment (plus, for the verifier only, the judge's API key variable named by
``verifier.judge.api_key_env``); the broker gets :data:`flywheel.broker.BROKER_ENV_ALLOW`. The environment,
umask and settings of the services are in :mod:`flywheel.service_env`, the supervisor's records of its
processes in :mod:`flywheel.supervision`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from flywheel.broker import (EmbeddedBroker, broker_env, die_with_parent, free_port, open_private_log, port_is_free,
                             stop_pid)
from flywheel.service_env import (DEFAULT_JUDGE_KEY_ENV, DEFAULT_UMASK, SERVICE_UMASK, allocator_env, allowed_env,
                                  judge_key_env, kafka_partitions, precision_plan)
from flywheel.supervision import (RestartPolicy, ServiceProcess, SupervisorEvent, cpu_seconds, exit_reason,
                                  log_tail, vm_hwm_bytes)
from shared.auth import auth_headers, ensure_token_file, write_private
from shared.config import KafkaConfig

log = logging.getLogger("flywheel")


#: Start order: the sandbox before the verifier, the scheduler last (it issues work at once).
SERVICES = ("sandbox", "verifier", "trainer", "rollout", "scheduler")

#: Services that serve Prometheus metrics on a port of their own (the scheduler and the sandbox use their API's).
METRICS_PORT_SERVICES = ("verifier", "trainer", "rollout")

#: The services that run torch (their allocator is ``run.allocator``).
TORCH_SERVICES = ("rollout", "trainer")


@dataclass
class LocalSystem:
    """A running local system. Build with :meth:`start`; supervise with :meth:`check`; stop with :meth:`stop`."""

    run_dir: Path
    env: dict[str, str]
    broker: EmbeddedBroker | None
    scheduler_url: str
    sandbox_url: str
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """The metrics port given to each of :data:`METRICS_PORT_SERVICES` (``FLYWHEEL_TELEMETRY__METRICS_PORT``),
    kept over restarts unless another process holds it then (:meth:`_reclaim_metrics_port`)."""
    token: str | None = None
    """The system's bearer token (``<run dir>/auth_token``), for callers of the mutating routes."""
    judge_key_env: str = DEFAULT_JUDGE_KEY_ENV
    """The variable the verifier (only) gets besides the allowlist: the judge's API key."""
    partitions: int = KafkaConfig().partitions
    """``kafka.partitions``: used to re-create the topics after a broker restart."""
    torch_env: dict[str, str] = field(default_factory=dict)
    """Added to the environment of the torch services (:data:`TORCH_SERVICES`): the allocator (:func:`allocator_env`)."""
    events: list[SupervisorEvent] = field(default_factory=list)
    """Every death seen, in order (:class:`SupervisorEvent`)."""
    broker_crashes: collections.deque = field(default_factory=collections.deque)
    broker_died_at: float | None = None
    """Monotonic time of the last broker death (``None``: never)."""
    commands: dict[str, list[str]] = field(default_factory=dict)
    """A command line per service name instead of ``python -m <name>_service`` (tests supervise small real
    programs this way)."""
    _notify: dict | None = None
    peak_rss: dict[str, int] = field(default_factory=dict)
    """Peak resident set size per process name, the broker included (bytes: ``VmHWM`` of
    ``/proc/<pid>/status``, the highest over the process's restarts), sampled by :meth:`sample_rss` (every
    :data:`RSS_SAMPLE_S` from :meth:`check`, and for the run report). A service's own process only: the sandbox's
    worker processes are not in its figure."""
    _rss_at: float = 0.0
    _cpu: dict[str, dict[int, float]] = field(default_factory=dict)
    """CPU seconds last read per process name and pid (every incarnation after a restart keeps its own)."""
    precision: dict[str, dict] = field(default_factory=dict)
    """The precision the torch services chose, by setting (:func:`precision_plan`): in ``flywheel.json`` and the
    run report."""

    #: Seconds between :meth:`check`'s peak-RSS samples.
    RSS_SAMPLE_S = 5.0

    def sample_rss(self) -> dict[str, int]:
        """Read every live process's peak RSS now, fold it into :attr:`peak_rss` and return a copy (bytes).
        A process that is gone keeps the figure of its last sample."""
        self._rss_at = time.monotonic()
        pids = {n: sp.process.pid for n, sp in self.services.items() if sp.process.poll() is None}
        if self.broker is not None and self.broker.process.poll() is None:
            pids["broker"] = self.broker.pid
        for name, pid in pids.items():
            hwm = vm_hwm_bytes(pid)
            if hwm:
                self.peak_rss[name] = max(self.peak_rss.get(name, 0), hwm)
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self._cpu.setdefault(name, {})[pid] = cpu
        return dict(self.peak_rss)

    @property
    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) per process name, the broker included, summed over the process's
        restarts, as of the last :meth:`sample_rss` (a process that died counts up to its last sample; the
        sandbox without its workers)."""
        return {name: round(sum(by_pid.values()), 2) for name, by_pid in self._cpu.items()}

    @property
    def metrics_urls(self) -> dict[str, str]:
        """``{service: URL of its Prometheus /metrics}`` for all five services."""
        urls = {"scheduler": f"{self.scheduler_url}/metrics", "sandbox": f"{self.sandbox_url}/metrics"}
        urls.update({n: f"http://127.0.0.1:{p}/metrics" for n, p in self.metrics_ports.items()})
        return {n: urls[n] for n in SERVICES if n in urls}

    @classmethod
    def start(cls, config_path: str | os.PathLike, run_dir: str | os.PathLike, overrides: dict[str, str] | None = None,
              bootstrap_servers: str | None = None, timeout_s: float = 180.0,
              policy: RestartPolicy | None = None) -> "LocalSystem":
        """Start the broker (unless ``bootstrap_servers`` is given) and every service; wait until healthy.

        Args:
            config_path: the system's YAML file.
            run_dir: logs, registry and checkpoints go here (created 0700).
            overrides: extra environment variables (``FLYWHEEL_<SECTION>__<FIELD>`` names).
            timeout_s: how long to wait for the HTTP services to answer ``/healthz``.
            policy: restarts (:class:`RestartPolicy`; default: its defaults).

        Raises:
            RuntimeError: a service died during start-up (its log tail is in the message).
            TimeoutError: a service did not become healthy in time.
            shared.auth.TokenError: the token file cannot be written.
        """
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        run_dir.chmod(0o700)
        (run_dir / "logs").mkdir(exist_ok=True, mode=0o700)
        token_file = run_dir / "auth_token"
        env = allowed_env(os.environ)
        env.update(overrides or {})
        token = env.get("FLYWHEEL_AUTH__TOKEN") or ensure_token_file(token_file)
        broker = None
        if bootstrap_servers is None:
            broker = EmbeddedBroker.start(log_path=run_dir / "logs" / "broker.log", env=broker_env(os.environ),
                                          with_parent=True)
            bootstrap_servers = broker.bootstrap_servers
        sandbox_port, scheduler_port, broadcast_port = free_port(), free_port(), free_port()
        env.update({  # what this system instance decides wins over the overrides
            "FLYWHEEL_CONFIG": str(Path(config_path).resolve()),
            "FLYWHEEL_RUN__DIR": str(run_dir),
            "FLYWHEEL_AUTH__TOKEN_FILE": str(token_file),
            "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": bootstrap_servers,
            "FLYWHEEL_SANDBOX__PORT": str(sandbox_port),
            "FLYWHEEL_WEIGHTS__BROADCAST_PORT": str(broadcast_port),
            "FLYWHEEL_SCHEDULER__PORT": str(scheduler_port),
            "FLYWHEEL_VERIFIER__SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
            "FLYWHEEL_ROLLOUT__SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        system = cls(run_dir, env, broker, f"http://127.0.0.1:{scheduler_port}", f"http://127.0.0.1:{sandbox_port}",
                     policy=policy or RestartPolicy(), metrics_ports={n: free_port() for n in METRICS_PORT_SERVICES},
                     token=token, judge_key_env=judge_key_env(config_path, env),
                     partitions=kafka_partitions(config_path, env), torch_env=allocator_env(config_path, env),
                     precision=precision_plan(config_path, env))
        try:
            if broker is not None:  # every topic before any client can auto-create one with the broker's default
                err = system._create_topics(strict=True)  # count (4 on Tansu: it capped verifier replicas at 4)
                if err:
                    raise RuntimeError(f"creating the topics on the embedded broker failed: {err}")
            for name in SERVICES:
                system._spawn(name)
            system.wait_healthy(timeout_s)
        except BaseException:
            system.stop()
            raise
        system.write_state()
        return system

    # ------------------------------------------------------------------ processes
    def service_env(self, name: str) -> dict[str, str]:
        """The environment of service ``name``: the system's (already allowlisted) plus its metrics port, the
        allocator of a torch service and, for the verifier, the judge's API key from the supervisor's own
        environment."""
        env = dict(self.env)
        if name in TORCH_SERVICES:
            env.update(self.torch_env)
        if name in self.metrics_ports:  # the same port on every restart (if free): a scraper keeps its target
            env["FLYWHEEL_TELEMETRY__METRICS_PORT"] = str(self.metrics_ports[name])
        if name == "verifier" and self.judge_key_env in os.environ and self.judge_key_env not in env:
            env[self.judge_key_env] = os.environ[self.judge_key_env]
        elif name != "verifier" and self.judge_key_env in env and not self.judge_key_env.startswith("FLYWHEEL_"):
            env.pop(self.judge_key_env)  # an allowlisted name that is the key: the verifier's alone
        return env

    def _spawn(self, name: str) -> None:
        log_path = self.run_dir / "logs" / f"{name}.out"
        out = open_private_log(log_path)
        try:
            cmd = self.commands.get(name) or [sys.executable, "-m", f"{name}_service"]
            proc = subprocess.Popen(cmd, env=self.service_env(name), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=self.run_dir, umask=SERVICE_UMASK.get(name, DEFAULT_UMASK),
                                    preexec_fn=die_with_parent())  # no orphans if the supervisor is killed
        finally:
            out.close()
        prev = self.services.get(name)
        sp = ServiceProcess(name, proc, log_path)
        if prev is not None:
            sp.restarts, sp.crashes, sp.streak = prev.restarts, prev.crashes, prev.streak
            if prev.event is not None:
                prev.event.new_pid = proc.pid
        self.services[name] = sp
        log.info("started %s (pid %d)", name, proc.pid)

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait for the scheduler's and the sandbox's ``/healthz``, failing fast if a service dies."""
        deadline = time.monotonic() + timeout_s
        pending = {self.scheduler_url, self.sandbox_url}
        while pending:
            for sp in self.services.values():
                if sp.process.poll() is not None:
                    raise RuntimeError(f"{sp.name} (pid {sp.process.pid}) died during start-up "
                                       f"({exit_reason(sp.process.returncode)}):\n{sp.tail()}")
            for url in list(pending):
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {sorted(pending)}")
            time.sleep(0.3)

    def check(self) -> list[str]:
        """Supervise once, without waiting: the broker first, then each service; due respawns; the
        scheduler's broker-restart notice. Returns messages about what happened.

        Raises:
            RuntimeError: a process died more than ``policy.max_restarts`` times within ``policy.window_s``
                (or the broker could not be restarted); the message names it and why.
        """
        notes: list[str] = []
        if time.monotonic() - self._rss_at >= self.RSS_SAMPLE_S:
            self.sample_rss()
        if self.broker is not None and self.broker.process.poll() is not None:
            notes += self._restart_broker()
        now = time.monotonic()
        for sp in self.services.values():
            if sp.restart_at is None and sp.process.poll() is not None:
                notes.append(self._on_death(sp, now))
        for name, sp in list(self.services.items()):  # respawns that are due, in start order
            if sp.restart_at is not None and time.monotonic() >= sp.restart_at:
                notes += self._reclaim_metrics_port(name)
                self._spawn(name)
                notes.append(f"restarted {name} (pid {self.services[name].process.pid})")
        notes += self._notify_scheduler()
        if notes:
            self.write_state()
        return notes

    def _reclaim_metrics_port(self, name: str) -> list[str]:
        """Before service ``name`` is respawned: keep its metrics port if a server could bind it now, else give
        it a new one (:func:`free_port`; ``flywheel.json`` gets the new URL). Another process can hold the port
        (the local end of a connection) and would otherwise crash the service at every restart. Returns a
        note when the port changed."""
        port = self.metrics_ports.get(name)
        if port is None or port_is_free(port):
            return []
        self.metrics_ports[name] = new = free_port()
        log.warning("%s's metrics port %d is taken by another process: it gets %d", name, port, new)
        return [f"{name}'s metrics port {port} was taken: now {new}"]

    def _window(self, crashes: collections.deque, now: float) -> int:
        """Drop deaths older than the window; the number left."""
        while crashes and now - crashes[0] > self.policy.window_s:
            crashes.popleft()
        return len(crashes)

    def _on_death(self, sp: ServiceProcess, now: float) -> str:
        """Record the death of ``sp``, schedule its respawn (or raise when over the limit); the message."""
        p = self.policy
        pid, reason = sp.process.pid, exit_reason(sp.process.returncode)
        broker_fault = self.broker_died_at is not None and now - self.broker_died_at <= p.broker_grace_s
        if broker_fault:
            when = ("the broker was down at the time" if now - self.broker_died_at < 1.0 else
                    f"the broker had died {now - self.broker_died_at:.0f} s before")
        else:
            when = "the broker was up" if self.broker is not None else "external broker"
        msg = f"service {sp.name} (pid {pid}) died: {reason}; {when}; last log lines:\n{sp.tail()}"
        sp.event = SupervisorEvent(time.time(), sp.name, pid, reason, counted=not broker_fault)
        self.events.append(sp.event)
        if now - sp.started_at >= p.stable_s:
            sp.streak = 0
        if broker_fault:
            delay, note = p.backoff_initial_s, "not counted (the broker's fault)"
        else:
            self._window(sp.crashes, now)
            if len(sp.crashes) >= p.max_restarts:
                raise RuntimeError(msg + f"\n{sp.name} died {len(sp.crashes) + 1} times within {p.window_s:.0f} s "
                                         f"(limit {p.max_restarts} restarts): stopping the system")
            sp.crashes.append(now)
            sp.streak += 1
            delay = p.backoff_s(sp.streak)
            note = f"restart {len(sp.crashes)} of at most {p.max_restarts} within {p.window_s:.0f} s"
        sp.restarts += 1
        sp.restart_at = now + delay
        return msg + f"\nrestarting {sp.name} in {delay:.1f} s ({note})"

    def _restart_broker(self) -> list[str]:
        """The broker died: report it, restart it on the same port, re-create the topics, and queue the
        scheduler's notice. Raises RuntimeError over the restart limit or when it cannot start again."""
        old, now, p = self.broker, time.monotonic(), self.policy
        reason = exit_reason(old.process.returncode)
        log_path = self.run_dir / "logs" / "broker.log"
        msg = f"broker (pid {old.pid}) died: {reason}; last log lines:\n{log_tail(log_path, 8)}"
        self.broker_died_at = now
        event = SupervisorEvent(time.time(), "broker", old.pid, reason, counted=True)
        self.events.append(event)
        if self._window(self.broker_crashes, now) >= p.max_restarts:
            raise RuntimeError(msg + f"\nthe broker died {len(self.broker_crashes) + 1} times within "
                                     f"{p.window_s:.0f} s (limit {p.max_restarts} restarts): stopping the system")
        self.broker_crashes.append(now)
        try:
            self.broker = EmbeddedBroker.start(port=old.port, host=old.host, log_path=log_path,
                                               env=broker_env(os.environ), with_parent=True)
        except (RuntimeError, TimeoutError, OSError) as e:
            raise RuntimeError(msg + f"\nthe broker could not be restarted on {old.bootstrap_servers}: {e}") from e
        event.new_pid = self.broker.pid
        restarted_at = time.time()
        notes = [msg + f"\nbroker restarted on {self.broker.bootstrap_servers} (pid {self.broker.pid}, empty: "
                       f"memory storage) {time.monotonic() - now:.1f} s after its death was seen"]
        err = self._create_topics()
        if err:
            notes.append(f"re-creating the topics failed (the scheduler will retry): {err}")
        self._notify = {"restarted_at": restarted_at, "tries": 0, "next": 0.0}
        return notes

    def _create_topics(self, timeout_s: float = 15.0, strict: bool = False) -> str | None:
        """Create every topic on the (new) broker before the services' clients auto-create them with the
        broker's default partition count, and check their counts (``strict``: a short one is an error,
        :class:`shared.kafka.TopicLayoutError`); returns an error message, or ``None``."""
        from shared.kafka import ensure_topics  # aiokafka: imported only when needed

        cfg = KafkaConfig(bootstrap_servers=self.broker.bootstrap_servers, partitions=self.partitions)
        box: list[BaseException] = []

        def go() -> None:
            try:
                asyncio.run(asyncio.wait_for(ensure_topics(cfg, strict=strict), timeout_s))
            except BaseException as e:  # reported, never raised: the scheduler re-creates them too
                box.append(e)

        t = threading.Thread(target=go, name="flywheel-topics", daemon=True)  # check() may run inside a loop
        t.start()
        t.join(timeout_s + 5)
        return f"{type(box[0]).__name__}: {box[0]}" if box else ("timed out" if t.is_alive() else None)

    #: Tries of the scheduler's broker-restart notice, and the seconds between them.
    NOTIFY_TRIES = 30
    NOTIFY_EVERY_S = 2.0

    def _notify_scheduler(self) -> list[str]:
        """POST the pending broker-restart notice to the scheduler (one try per call, every
        :attr:`NOTIFY_EVERY_S`, at most :attr:`NOTIFY_TRIES`)."""
        n = self._notify
        if n is None or time.monotonic() < n["next"]:
            return []
        n["tries"] += 1
        try:
            r = httpx.post(f"{self.scheduler_url}/v1/system/broker-restarted", json={"restarted_at": n["restarted_at"]},
                           headers=auth_headers(self.token), timeout=5)
            r.raise_for_status()
        except httpx.HTTPError as e:
            if n["tries"] >= self.NOTIFY_TRIES:
                self._notify = None
                return [f"could not tell the scheduler about the broker restart after {n['tries']} tries ({e!r}); "
                        "it re-issues the lost groups when it notices the restart itself"]
            n["next"] = time.monotonic() + self.NOTIFY_EVERY_S
            return []
        self._notify = None
        body = r.json()
        return [f"scheduler told of the broker restart: re-issued {body.get('reissued', '?')} in-flight groups"]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every service (reverse start order), then the broker; SIGKILL what lingers."""
        for name in reversed(list(self.services)):
            stop_pid(self.services[name].process, timeout_s)
        if self.broker is not None:
            self.broker.stop()
        state = self.run_dir / "flywheel.json"
        state.unlink(missing_ok=True)

    # ------------------------------------------------------------------ state file
    def write_state(self) -> None:
        """``<run dir>/flywheel.json`` (mode 0600): pids and URLs, for ``flywheel status`` and ``flywheel down``."""
        state = {
            "supervisor_pid": os.getpid(), "run_dir": str(self.run_dir), "scheduler_url": self.scheduler_url,
            "sandbox_url": self.sandbox_url, "bootstrap_servers": self.env["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"],
            "broker_pid": self.broker.pid if self.broker else None,
            "services": {n: sp.process.pid for n, sp in self.services.items()},
            "metrics_urls": self.metrics_urls,
            "precision": self.precision,
        }
        write_private(self.run_dir / "flywheel.json", orjson.dumps(state, option=orjson.OPT_INDENT_2))
