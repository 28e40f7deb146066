"""A supervisor killed with SIGKILL leaves nothing running (``flywheel.broker.die_with_parent``).

A real supervisor process (``LocalSystem`` spawning small real programs, and the real embedded broker started
as ``flywheel run`` starts it) is killed with ``kill -9``: its services and its broker must end by themselves
within seconds. A child the same supervisor starts without the hook must survive the kill: the check can fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


SUPERVISOR = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    from flywheel.broker import EmbeddedBroker
    from flywheel.launcher import LocalSystem

    run_dir = Path(sys.argv[1])
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    broker = EmbeddedBroker.start(log_path=run_dir / "logs" / "broker.log", with_parent=True)
    system = LocalSystem(run_dir, {"PATH": os.environ["PATH"]}, broker, "http://127.0.0.1:1", "http://127.0.0.1:1",
                         commands={"trainer": sleeper, "verifier": sleeper})
    for name in ("trainer", "verifier"):
        system._spawn(name)
    control = subprocess.Popen(sleeper, start_new_session=True)  # no hook: outlives the supervisor
    pids = {n: sp.process.pid for n, sp in system.services.items()}
    pids.update(broker=broker.pid, control=control.pid)
    (run_dir / "pids.json").write_text(json.dumps(pids))
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie left for init to reap counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the supervisor exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the supervisor did not start its children"
        time.sleep(0.05)
    time.sleep(0.1)  # written in one call; let it land
    return json.loads(path.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_services_and_broker_end_when_the_supervisor_is_killed(tmp_path):
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], start_new_session=True)
    pids: dict = {}
    try:
        pids = _wait_for(tmp_path / "pids.json", sup, timeout_s=60)
        assert all(_alive(p) for p in pids.values()), pids
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        deadline = time.monotonic() + 15
        hooked = {n: p for n, p in pids.items() if n != "control"}
        while any(_alive(p) for p in hooked.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [n for n, p in hooked.items() if _alive(p)], "still running after the supervisor's SIGKILL"
        assert _alive(pids["control"]), "the child without the hook should outlive its parent"
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
        for p in pids.values():
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_ends_at_once():
    """The race between fork and prctl: the hook built for a parent pid that is not the child's parent
    (as after the parent's death) makes the child signal itself before it runs anything."""
    code = textwrap.dedent("""
        import os, signal, subprocess, sys
        from flywheel.broker import die_with_parent
        hook = die_with_parent(signal.SIGTERM)  # built for this process ...
        r, w = os.pipe()
        if os.fork() == 0:  # ... but run in a grandchild, whose parent is not it
            os.close(r)
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=hook)
            os.write(w, str(p.wait()).encode())
            os._exit(0)
        os.close(w)
        print(os.read(r, 64).decode())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(-signal.SIGTERM), (out.stdout, out.stderr)


def test_down_signals_only_processes_that_are_still_the_systems():
    """``flywheel down`` after the supervisor died: a recorded pid is signalled only while its command line
    still names the process (a pid reused by another program is left alone)."""
    from flywheel.cli.system import _still

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # trainer_service"])
    try:
        # Popen returns once the child's exec has closed its error pipe, which the kernel does before it
        # lays out the new program's arguments: for a moment the command line reads empty. (The services
        # `down` looks at have run for seconds at least.)
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{child.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _still(child.pid, "trainer_service"), (child.poll(), Path(f"/proc/{child.pid}/cmdline").read_bytes())
        assert not _still(child.pid, "tansu")  # the same pid, now some other program's
    finally:
        child.kill()
        child.wait(10)
    assert not _still(child.pid, "trainer_service")
    assert not _still(None, "tansu")
