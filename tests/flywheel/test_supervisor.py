"""The supervisor (``LocalSystem.check``) on small real programs and the real embedded broker.

The supervised "services" are tiny Python programs (``LocalSystem.commands``) that exit or sleep on cue, so
the restart rules are exercised with real processes, real signals and real time: the sliding window, the
backoff (scheduled, never slept inside ``check``), the messages (pid, signal name, log lines, whether the
broker was down), and the broker restarted on its own port without blaming the services it took down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from flywheel.broker import EmbeddedBroker, free_port
from flywheel.launcher import LocalSystem
from flywheel.service_env import allowed_env
from flywheel.supervision import RestartPolicy, exit_reason
from shared import topics


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


CRASH = _py("import sys; print('about to fail', flush=True); sys.exit(3)")
SLEEP = _py("import time; print('hello from the sleeper', flush=True); time.sleep(120)")


def _system(tmp_path: Path, policy: RestartPolicy, commands: dict[str, list[str]],
            broker: EmbeddedBroker | None = None) -> LocalSystem:
    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS":
           broker.bootstrap_servers if broker else "127.0.0.1:1"}
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the broker-restart notice is refused at once
    system = LocalSystem(tmp_path, env, broker, dead, dead, policy=policy, commands=commands)
    for name in commands:
        system._spawn(name)
    return system


def _until(system: LocalSystem, pred, timeout_s: float, every_s: float = 0.02) -> list[str]:
    """Call ``check()`` until ``pred(notes so far)`` holds; the notes. Raises AssertionError at the deadline."""
    notes: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not pred(notes):
        assert time.monotonic() < deadline, f"timed out; notes so far: {notes}"
        notes += system.check()
        time.sleep(every_s)
    return notes


def _deaths(notes: list[str]) -> int:
    return sum(" died: " in n for n in notes)


def test_exit_reason_names_the_signal():
    assert exit_reason(-9) == "killed by SIGKILL"
    assert exit_reason(-15) == "killed by SIGTERM"
    assert exit_reason(2) == "exit code 2"


def test_crashes_spread_over_more_than_the_window_keep_running_quick_ones_stop(tmp_path):
    """max_restarts=2 in a 1.5 s window: four deaths about 1.2 s apart never fill the window (the old supervisor
    counted over the whole run and stopped at the third); three in quick succession stop the system."""
    slow = _py("import sys, time; time.sleep(1.0); sys.exit(3)")
    system = _system(tmp_path / "a", RestartPolicy(max_restarts=2, window_s=1.5, backoff_initial_s=0.05,
                                                   backoff_max_s=0.05, stable_s=100), {"slow": slow})
    try:
        notes = _until(system, lambda n: _deaths(n) >= 4, timeout_s=30)
        assert system.services["slow"].restarts >= 4
    finally:
        system.stop()
    assert all("exit code 3" in n for n in notes if " died: " in n), notes

    system = _system(tmp_path / "b", RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.05,
                                                   backoff_max_s=0.05), {"quick": CRASH})
    try:
        with pytest.raises(RuntimeError, match=r"quick died 3 times within 60 s .*stopping the system") as e:
            _until(system, lambda n: False, timeout_s=30)
        assert "about to fail" in str(e.value) and "exit code 3" in str(e.value)
    finally:
        system.stop()


def test_backoff_doubles_is_scheduled_not_slept_and_resets_after_a_stable_run(tmp_path):
    """Restarts of a crash-looping program wait 0.3, 0.6, 1.2, 1.2 s (cap); meanwhile check() returns at once and
    another program killed during the wait is restarted on its own schedule, not after the first one's wait."""
    policy = RestartPolicy(max_restarts=20, window_s=60, backoff_initial_s=0.3, backoff_max_s=1.2, stable_s=100)
    system = _system(tmp_path, policy, {"loop": CRASH, "sleeper": SLEEP})
    try:
        died, respawned, slowest = [], [], 0.0
        killed_sleeper_at = None
        deadline = time.monotonic() + 40
        while len(respawned) < 4:
            assert time.monotonic() < deadline, (died, respawned)
            t = time.monotonic()
            notes = system.check()
            slowest = max(slowest, time.monotonic() - t)
            for n in notes:
                if n.startswith("service loop"):
                    died.append(t)
                elif n.startswith("restarted loop"):
                    respawned.append(t)
                elif n.startswith("restarted sleeper"):
                    sleeper_back = t
            if len(died) == 2 and killed_sleeper_at is None:  # during the loop's 0.6 s wait
                os.kill(system.services["sleeper"].process.pid, signal.SIGKILL)
                killed_sleeper_at = time.monotonic()
            time.sleep(0.01)
        waits = [r - d for d, r in zip(died, respawned)]
        for got, want in zip(waits, [0.3, 0.6, 1.2, 1.2]):
            assert want - 0.05 <= got <= want + 0.5, waits
        assert slowest < 0.25, slowest  # check() never sleeps out a backoff
        assert sleeper_back - killed_sleeper_at < 0.3 + 0.5  # its own first-restart wait, not the loop's
    finally:
        system.stop()

    stable = _py("import sys, time; time.sleep(0.6); sys.exit(1)")  # runs longer than stable_s every time
    system = _system(tmp_path / "s", RestartPolicy(max_restarts=20, window_s=60, backoff_initial_s=0.3,
                                                   backoff_max_s=5, stable_s=0.5), {"stable": stable})
    try:
        notes = _until(system, lambda n: _deaths(n) >= 3, timeout_s=30)
    finally:
        system.stop()
    assert all("restarting stable in 0.3 s" in n for n in notes if " died: " in n), notes


def test_a_killed_service_is_named_with_pid_signal_and_last_log_lines(tmp_path):
    system = _system(tmp_path, RestartPolicy(backoff_initial_s=0.05), {"sleeper": SLEEP}, broker=None)
    try:
        _until(system, lambda n: "hello from the sleeper" in system.services["sleeper"].tail(), timeout_s=20)
        pid = system.services["sleeper"].process.pid
        os.kill(pid, signal.SIGKILL)
        notes = _until(system, lambda n: any(x.startswith("restarted sleeper") for x in n), timeout_s=20)
    finally:
        system.stop()
    msg = next(n for n in notes if " died: " in n)
    assert msg.startswith(f"service sleeper (pid {pid}) died: killed by SIGKILL"), msg
    assert "hello from the sleeper" in msg and "restarting sleeper in 0.1 s" in msg
    ev = system.events[-1]
    assert (ev.process, ev.pid, ev.reason, ev.counted) == ("sleeper", pid, "killed by SIGKILL", True)
    assert ev.new_pid == system.services["sleeper"].process.pid != pid


async def _topic_names(bootstrap: str) -> set[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


def test_a_killed_broker_is_restarted_on_its_port_first_and_the_services_it_took_down_are_not_blamed(tmp_path):
    """kill -9 of the broker and (its victim) a service at once: check() reports the broker first, restarts it on
    the same port with every topic re-created, and the service's death is not counted and is said to have happened
    while the broker was down. A second broker death within the window (max_restarts=1) stops the system."""
    broker = EmbeddedBroker.start(log_path=tmp_path / "broker.log")
    system = _system(tmp_path, RestartPolicy(max_restarts=1, backoff_initial_s=0.05), {"victim": SLEEP},
                     broker=broker)
    try:
        old_pid, port = broker.pid, broker.port
        victim = system.services["victim"].process.pid
        os.kill(old_pid, signal.SIGKILL)
        os.kill(victim, signal.SIGKILL)
        broker.process.wait(10)
        system.services["victim"].process.wait(10)
        t0 = time.monotonic()
        notes = system.check()
        restarted_in = time.monotonic() - t0
        assert notes[0].startswith(f"broker (pid {old_pid}) died: killed by SIGKILL"), notes
        assert f"broker restarted on 127.0.0.1:{port}" in notes[0]
        assert system.broker.port == port and system.broker.pid != old_pid and system.broker.process.poll() is None
        msg = next(n for n in notes if n.startswith("service victim"))
        assert f"(pid {victim}) died: killed by SIGKILL; the broker was down at the time" in msg
        assert "not counted (the broker's fault)" in msg
        assert set(topics.ALL) <= asyncio.run(_topic_names(system.broker.bootstrap_servers))
        _until(system, lambda n: any(x.startswith("restarted victim") for x in n), timeout_s=10)
        assert [(e.process, e.counted) for e in system.events] == [("broker", True), ("victim", False)]
        assert system.events[0].new_pid == system.broker.pid
        print(f"broker restart with topics: {restarted_in:.2f} s")
        # a second broker death within the window is over max_restarts=0: the system stops, naming the broker
        os.kill(system.broker.pid, signal.SIGKILL)
        system.broker.process.wait(10)
        with pytest.raises(RuntimeError, match=r"the broker died 2 times within 600 s"):
            system.check()
    finally:
        system.stop()


def test_the_services_environment_passes_torch_knobs_and_nothing_else():
    """oneDNN's variables (torch's CPU kernels: ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` caps the compiled-shape
    cache that eager attention fills) reach the services; a secret of the operator's shell does not."""
    shell = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "DNNL_VERBOSE": "0", "TORCH_SHOW_CPP_STACKTRACES": "1",
             "AWS_SECRET_ACCESS_KEY": "planted", "PATH": "/usr/bin"}
    assert allowed_env(shell) == {k: v for k, v in shell.items() if k != "AWS_SECRET_ACCESS_KEY"}


#: A "service" that serves on its metrics port the way the real ones do (``SO_REUSEADDR``), or exits 2 when it
#: cannot bind it.
METRICS_SERVER = _py(
    "import os, socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "port = int(os.environ['FLYWHEEL_TELEMETRY__METRICS_PORT'])\n"
    "try:\n    s.bind(('127.0.0.1', port))\n"
    "except OSError as e:\n    print('cannot bind', port, e, flush=True); sys.exit(2)\n"
    "s.listen(); print('serving on', port, flush=True); time.sleep(120)\n")


def _metrics_system(tmp_path: Path) -> LocalSystem:
    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    dead = f"http://127.0.0.1:{free_port()}"
    system = LocalSystem(tmp_path, env, None, dead, dead, commands={"rollout": METRICS_SERVER},
                         policy=RestartPolicy(max_restarts=2, backoff_initial_s=0.05, backoff_max_s=0.05),
                         metrics_ports={"rollout": free_port()})
    system._spawn("rollout")
    return system


def _restart_after_kill(system: LocalSystem, hold=None) -> list[str]:
    port = system.metrics_ports["rollout"]
    _until(system, lambda n: f"serving on {port}" in system.services["rollout"].tail(), timeout_s=20)
    os.kill(system.services["rollout"].process.pid, signal.SIGKILL)
    system.services["rollout"].process.wait()
    if hold is not None:
        hold(port)
    notes = _until(system, lambda n: any(x.startswith("restarted rollout") for x in n), timeout_s=20)
    new = system.metrics_ports["rollout"]
    times = 2 if new == port else 1  # the log file is shared by the incarnations: the killed one said it once
    _until(system, lambda n: system.services["rollout"].tail().count(f"serving on {new}") >= times, timeout_s=20)
    assert system.services["rollout"].process.poll() is None
    return notes


def test_a_restarted_service_keeps_its_metrics_port_while_it_is_free(tmp_path):
    system = _metrics_system(tmp_path)
    port = system.metrics_ports["rollout"]
    try:
        notes = _restart_after_kill(system)
    finally:
        system.stop()
    assert system.metrics_ports["rollout"] == port
    assert not any("metrics port" in n for n in notes), notes


def test_a_metrics_port_taken_by_a_connection_while_the_service_was_down_is_replaced_and_reported(tmp_path):
    """The port's new holder is the local end of a connection, as an outgoing Kafka connection's would be: the
    service, which binds with SO_REUSEADDR, still cannot bind it. The restart gets a fresh port (not a crash loop)
    and ``flywheel.json`` names it."""
    import orjson

    held: list = []

    def hold(port: int) -> None:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.socket()
        client.bind(("127.0.0.1", port))
        client.connect(server.getsockname())
        held.extend([server, client, server.accept()[0]])

    system = _metrics_system(tmp_path)
    port = system.metrics_ports["rollout"]
    try:
        notes = _restart_after_kill(system, hold)
        assert system.services["rollout"].process.poll() is None  # serving, not crash-looping
        state = orjson.loads((tmp_path / "flywheel.json").read_bytes())  # removed by stop()
    finally:
        system.stop()
        for s in held:
            s.close()
    new = system.metrics_ports["rollout"]
    assert new != port
    assert f"rollout's metrics port {port} was taken: now {new}" in notes
    assert state["metrics_urls"]["rollout"] == f"http://127.0.0.1:{new}/metrics"
