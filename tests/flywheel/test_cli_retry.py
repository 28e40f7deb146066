"""The job's client of the scheduler (``flywheel.cli.client.SchedulerApi``) against a real scheduler app (REST
only, no Kafka) that starts late: it supervises while it retries, says once that the scheduler is unreachable and when it
answers again, gives up at its deadline, and lets the supervisor's give-up through."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flywheel.broker import free_port
from flywheel.cli.client import SchedulerApi
from flywheel.cli.common import console
from flywheel.config import FlywheelConfig
from scheduler_service.api import create_app
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared.client import ApiUnreachable
from shared.config import RunConfig


@dataclass
class Supervised:
    """Stands for LocalSystem: the URL, and a ``check`` that records its calls (or gives up)."""

    scheduler_url: str
    run_dir: Path
    checks: list[float] = field(default_factory=list)
    give_up: bool = False

    def check(self) -> list[str]:
        self.checks.append(time.monotonic())
        if self.give_up:
            raise RuntimeError("scheduler died 6 times within 600 s: stopping the system")
        return []


@pytest.fixture
def late_scheduler(tmp_path):
    """A scheduler app on a free port that starts serving 2 s from now (in a thread); its URL."""
    import uvicorn

    cfg = FlywheelConfig(run=RunConfig(dir=str(tmp_path)))
    registry = Registry.from_url(cfg.scheduler.database_url, cfg.run)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, SchedulerState(cfg, registry, kafka=False)),
                                           host="127.0.0.1", port=port, log_level="warning"))

    def serve():
        time.sleep(2.0)
        server.run()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        registry.close()
    assert not thread.is_alive()


def test_the_job_supervises_while_it_retries_and_says_so_once(late_scheduler, tmp_path):
    system = Supervised(late_scheduler, tmp_path)
    api = SchedulerApi(system, None, retry_s=30)
    with console.capture() as cap:
        try:
            st = api.get("/v1/status")
            api.get("/v1/status")
        finally:
            api.close()
    out = cap.get()
    assert st["policy_version"] == 0
    assert out.count("scheduler unreachable") == 1 and out.count("answering again") == 1, out
    assert "ConnectError" in out and "retrying for up to 30 s" in out
    gaps = [b - a for a, b in zip(system.checks, system.checks[1:])]
    assert len(system.checks) >= 3 and max(gaps) <= 1.2, gaps  # supervised at least every second


def test_the_job_gives_up_at_its_deadline_and_lets_the_supervisors_give_up_through(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    api = SchedulerApi(Supervised(url, tmp_path), None, retry_s=1.0)
    with pytest.raises(ApiUnreachable, match="no usable answer after .* attempts in 1.* s; last error: ConnectError"):
        api.get("/v1/status")
    api.close()
    api = SchedulerApi(Supervised(url, tmp_path, give_up=True), None, retry_s=30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="stopping the system"):
        api.get("/v1/status")
    assert time.monotonic() - t0 < 2.0
    api.close()
