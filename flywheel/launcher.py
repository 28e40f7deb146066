"""Starting, supervising and stopping a local Flywheel system: the embedded broker plus five services.

Each service is a separate process (``python -m <service>``) in its own session, started with the
same YAML config and environment overrides, logging under ``<run dir>/logs``. The supervisor
notices a dead service, says which and why (exit code, last log lines), and restarts it a bounded
number of times before stopping the whole system cleanly. Everything is stopped by pid.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from flywheel.broker import EmbeddedBroker, free_port, stop_pid

log = logging.getLogger("flywheel")

#: Start order: the sandbox before the verifier, the scheduler last (it issues work at once).
SERVICES = ("sandbox", "verifier", "trainer", "rollout", "scheduler")
#: Services that serve Prometheus metrics on a port of their own (the scheduler and the sandbox use their API's).
METRICS_PORT_SERVICES = ("verifier", "trainer", "rollout")


@dataclass
class ServiceProcess:
    """One supervised service process."""

    name: str
    process: subprocess.Popen
    log_path: Path
    restarts: int = 0

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class LocalSystem:
    """A running local system. Build with :meth:`start`; stop with :meth:`stop`."""

    run_dir: Path
    env: dict[str, str]
    broker: EmbeddedBroker | None
    scheduler_url: str
    sandbox_url: str
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    max_restarts: int = 2
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """The metrics port given to each of :data:`METRICS_PORT_SERVICES` (``FLYWHEEL_TELEMETRY__METRICS_PORT``),
    kept over restarts."""

    @property
    def metrics_urls(self) -> dict[str, str]:
        """``{service: URL of its Prometheus /metrics}`` for all five services."""
        urls = {"scheduler": f"{self.scheduler_url}/metrics", "sandbox": f"{self.sandbox_url}/metrics"}
        urls.update({n: f"http://127.0.0.1:{p}/metrics" for n, p in self.metrics_ports.items()})
        return {n: urls[n] for n in SERVICES if n in urls}

    @classmethod
    def start(cls, config_path: str | os.PathLike, run_dir: str | os.PathLike, overrides: dict[str, str] | None = None,
              bootstrap_servers: str | None = None, timeout_s: float = 180.0) -> "LocalSystem":
        """Start the broker (unless ``bootstrap_servers`` is given) and every service; wait until healthy.

        Args:
            config_path: the system's YAML file.
            run_dir: logs, registry and checkpoints go here.
            overrides: extra environment variables (``FLYWHEEL_<SECTION>__<FIELD>`` names).
            timeout_s: how long to wait for the HTTP services to answer ``/healthz``.

        Raises:
            RuntimeError: a service died during start-up (its log tail is in the message).
            TimeoutError: a service did not become healthy in time.
        """
        run_dir = Path(run_dir).resolve()
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        broker = None
        if bootstrap_servers is None:
            broker = EmbeddedBroker.start(log_path=run_dir / "logs" / "broker.log")
            bootstrap_servers = broker.bootstrap_servers
        sandbox_port, scheduler_port, broadcast_port = free_port(), free_port(), free_port()
        env = dict(os.environ)
        env.update(overrides or {})
        env.update({  # what this system instance decides wins over the overrides
            "FLYWHEEL_CONFIG": str(Path(config_path).resolve()),
            "FLYWHEEL_RUN__DIR": str(run_dir),
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
                     metrics_ports={n: free_port() for n in METRICS_PORT_SERVICES})
        try:
            for name in SERVICES:
                system._spawn(name)
            system.wait_healthy(timeout_s)
        except BaseException:
            system.stop()
            raise
        system.write_state()
        return system

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str) -> None:
        log_path = self.run_dir / "logs" / f"{name}.out"
        out = open(log_path, "ab")
        env = self.env
        if name in self.metrics_ports:  # the same port on every restart: a scraper keeps its target
            env = {**env, "FLYWHEEL_TELEMETRY__METRICS_PORT": str(self.metrics_ports[name])}
        proc = subprocess.Popen([sys.executable, "-m", f"{name}_service"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=self.run_dir)
        out.close()
        prev = self.services.get(name)
        self.services[name] = ServiceProcess(name, proc, log_path, prev.restarts if prev else 0)
        log.info("started %s (pid %d)", name, proc.pid)

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait for the scheduler's and the sandbox's ``/healthz``, failing fast if a service dies."""
        deadline = time.monotonic() + timeout_s
        pending = {self.scheduler_url, self.sandbox_url}
        while pending:
            for sp in self.services.values():
                if sp.process.poll() is not None:
                    raise RuntimeError(f"{sp.name} exited with code {sp.process.returncode} during start-up:\n"
                                       f"{sp.tail()}")
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
        """Supervise once: restart each dead service (bounded). Returns messages about what happened.

        Raises:
            RuntimeError: a service died more than ``max_restarts`` times.
        """
        notes = []
        for name, sp in list(self.services.items()):
            code = sp.process.poll()
            if code is None:
                continue
            msg = f"service {name} (pid {sp.process.pid}) exited with code {code}; last log lines:\n{sp.tail()}"
            if sp.restarts >= self.max_restarts:
                raise RuntimeError(msg + f"\n{name} died {sp.restarts + 1} times: stopping the system")
            sp.restarts += 1
            notes.append(msg + f"\nrestarting {name} ({sp.restarts}/{self.max_restarts})")
            self._spawn(name)
        if notes:
            self.write_state()
        return notes

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every service (reverse start order), then the broker; SIGKILL what lingers."""
        for name in reversed(SERVICES):
            sp = self.services.get(name)
            if sp is not None:
                stop_pid(sp.process, timeout_s)
        if self.broker is not None:
            self.broker.stop()
        state = self.run_dir / "flywheel.json"
        state.unlink(missing_ok=True)

    # ------------------------------------------------------------------ state file
    def write_state(self) -> None:
        """``<run dir>/flywheel.json``: pids and URLs, for ``flywheel status`` and ``flywheel down``."""
        state = {
            "supervisor_pid": os.getpid(), "run_dir": str(self.run_dir), "scheduler_url": self.scheduler_url,
            "sandbox_url": self.sandbox_url, "bootstrap_servers": self.env["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"],
            "broker_pid": self.broker.pid if self.broker else None,
            "services": {n: sp.process.pid for n, sp in self.services.items()},
            "metrics_urls": self.metrics_urls,
        }
        (self.run_dir / "flywheel.json").write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))


def overrides_to_env(pairs: list[str]) -> dict[str, str]:
    """``["budget.max_steps=3"]`` → ``{"FLYWHEEL_BUDGET__MAX_STEPS": "3"}``.

    Raises:
        ValueError: a pair is not ``section.field=value``.
    """
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"override {pair!r} is not section.field=value")
        env["FLYWHEEL_" + key.replace(".", "__").upper()] = value
    return env
