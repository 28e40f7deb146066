"""A whole local system (embedded broker, five services, a tiny model, the toy domain of examples/toy.yaml)
under the supervisor: private files, a scrubbed environment, a working sandbox under the launcher's umask,
and a kill -9 of the broker from which training resumes (the time to the next trainer step is printed).

One LocalSystem is shared by the module (started once, stopped by pid at the end).
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest

from flywheel.config import load_config
from flywheel.launcher import SERVICES, LocalSystem
from flywheel.supervision import RestartPolicy, cpu_seconds
from flywheel.tasks import make_tasks
from shared.auth import auth_headers
from shared.model import build_tiny_model

pytestmark = pytest.mark.e2e  # a whole supervised system, a broker kill among the tests: the e2e tier

ROOT = Path(__file__).resolve().parents[2]
SECRET = "AWS_SECRET_ACCESS_KEY"
"""A planted secret of the operator's shell that no process of the system may inherit."""
JUDGE_KEY = "OPENAI_API_KEY"
"""``verifier.judge.api_key_env``'s default: the verifier, and only it, gets it."""
BROKER_STEP_BOUND_S = 120.0
"""Generous bound on broker kill -> next trainer step in this test (the target is a median <= 30 s)."""


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervised")
    tiny = build_tiny_model(tmp / "tiny")
    saved = {k: os.environ.get(k) for k in (SECRET, JUDGE_KEY)}
    os.environ[SECRET] = "planted-aws-secret-do-not-leak"
    os.environ[JUDGE_KEY] = "planted-judge-key"
    overrides = {"FLYWHEEL_MODEL__NAME": str(tiny), "FLYWHEEL_BUDGET__MAX_STEPS": "1000"}
    try:
        s = LocalSystem.start(ROOT / "examples/toy.yaml", tmp / "run", overrides, timeout_s=240,
                              policy=RestartPolicy(backoff_initial_s=0.5))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        cfg = load_config(ROOT / "examples/toy.yaml")
        r = httpx.post(f"{s.scheduler_url}/v1/tasks", json={"tasks": make_tasks(cfg.tasks)},
                       headers=auth_headers(s.token), timeout=60)
        assert r.status_code == 202, r.text
        yield s
    finally:
        s.stop()


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def _version(system: LocalSystem) -> int:
    return httpx.get(f"{system.scheduler_url}/v1/status", timeout=10).json()["policy_version"]


def _supervise_until(system: LocalSystem, pred, timeout_s: float, notes: list[str]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        notes += system.check()
        try:
            v = pred()
        except httpx.HTTPError:
            v = None
        if v:
            return v
        time.sleep(0.25)
    return None


def test_run_dir_is_0700_and_its_files_0600(system):
    run = system.run_dir
    assert _mode(run) == 0o700 and _mode(run / "logs") == 0o700
    for name in ("flywheel.json", "auth_token", "flywheel-registry.db"):
        assert _mode(run / name) == 0o600, name
    for name in SERVICES:
        assert _mode(run / "logs" / f"{name}.out") == 0o600, name
    assert (run / "auth_token").read_text().strip() == system.token


def test_no_service_and_not_the_broker_inherits_a_secret_and_only_the_verifier_gets_the_judge_key(system):
    pids = {n: sp.process.pid for n, sp in system.services.items()}
    for name, pid in pids.items():
        env = _environ(pid)
        assert SECRET not in env, name
        assert (JUDGE_KEY in env) == (name == "verifier"), name
        assert env["FLYWHEEL_AUTH__TOKEN_FILE"] == str(system.run_dir / "auth_token"), name
        assert "FLYWHEEL_AUTH__TOKEN" not in env, name
    broker = _environ(system.broker.pid)
    assert SECRET not in broker and JUDGE_KEY not in broker
    assert not any(k.startswith("FLYWHEEL_") for k in broker), sorted(broker)


def test_the_sandbox_runs_code_under_the_launchers_umask(system):
    r = httpx.post(f"{system.sandbox_url}/v1/execute", json={"code": "print(6 * 7)"},
                   headers=auth_headers(system.token), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["stdout"] == "42\n", r.json()


def test_the_launcher_created_every_topic_with_its_partition_count_before_the_services(system):
    """flywheel.trajectories once came up with the broker's default 4 partitions instead of 8 (a
    client touched it before anyone created it); the launcher now creates every topic before any service."""
    import asyncio

    from shared import topics
    from shared.config import KafkaConfig
    from shared.kafka import ensure_topics

    cfg = KafkaConfig(bootstrap_servers=system.broker.bootstrap_servers, partitions=system.partitions)
    assert asyncio.run(ensure_topics(cfg, topics.ALL)) == {}  # every one there with at least its count
    assert system.partitions == 8  # above the broker's auto-create default of 4: a short topic would show


def test_training_resumes_after_a_broker_kill_9(system):
    """kill -9 of the broker mid-run: the supervisor names it, restarts it on the same port, the services keep
    running (none is blamed) and training goes on. Printed: the time from the kill to each of the next three
    policy versions (the first may be a step whose batch was already in the trainer's memory; the third needs
    groups issued, generated and scored through the new broker) and the step interval before the kill."""
    notes: list[str] = []
    assert _supervise_until(system, lambda: _version(system) >= 3, 300, notes), f"no training: {notes}"
    t0, v0 = time.monotonic(), _version(system)
    assert _supervise_until(system, lambda: _version(system) >= v0 + 2, 120, notes)
    interval = (time.monotonic() - t0) / 2
    old_pid, port = system.broker.pid, system.broker.port
    before = _version(system)
    os.kill(old_pid, signal.SIGKILL)
    killed = time.monotonic()
    times = []
    for k in (1, 2, 3):
        got = _supervise_until(system, lambda: _version(system) >= before + k, BROKER_STEP_BOUND_S, notes)
        times.append(time.monotonic() - killed if got else None)
    print(f"broker kill -9 at policy version {before} -> versions +1/+2/+3 after "
          f"{', '.join('-' if t is None else f'{t:.1f} s' for t in times)} (step interval before: {interval:.1f} s)")
    joined = "\n".join(notes)
    assert any(n.startswith(f"broker (pid {old_pid}) died: killed by SIGKILL") for n in notes), joined
    assert system.broker.port == port and system.broker.pid != old_pid
    assert None not in times, f"training did not resume within {BROKER_STEP_BOUND_S:.0f} s:\n{joined}"
    assert all(e.process == "broker" or not e.counted for e in system.events), system.events


def test_cpu_seconds_per_process_sum_every_incarnation(system):
    """The run report's ``cpu_seconds``: every process of the system has a figure, and the broker's (killed
    and restarted by the test before) counts both its processes, not only the live one."""
    system.sample_rss()
    cpu = system.cpu_seconds
    assert set(cpu) == {*SERVICES, "broker"}, cpu
    assert all(c > 0 for c in cpu.values()), cpu
    live = cpu_seconds(system.broker.pid)
    assert live is not None and len(system._cpu["broker"]) == 2 and cpu["broker"] > live, (cpu, live)
    assert cpu_seconds(2**22 + 1) is None  # no such process
