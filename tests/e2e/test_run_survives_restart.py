"""`flywheel run` survives a kill -9 of the scheduler mid-run: the CLI's polls retry
while the supervisor restarts the scheduler, and the job reaches ``max_steps`` and writes its report.
Five service processes, the embedded broker, a tiny model, the toy domain (~40 s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel.broker import die_with_parent

from tests.support.system import procs_under

from shared.auth import auth_headers, token_from_run_dir
from shared.model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
KILL_AT = 4


_procs_under = procs_under


def _status(state: dict) -> dict | None:
    try:
        r = httpx.get(f"{state['scheduler_url']}/v1/status", timeout=5,
                      headers=auth_headers(token_from_run_dir(state["run_dir"])))
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_flywheel_run_survives_a_kill_9_of_the_scheduler(tiny, tmp_path):
    report, out = tmp_path / "report.json", tmp_path / "cli.out"
    cmd = [sys.executable, "-m", "flywheel.cli", "run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}",
           "--set", f"run.dir={tmp_path / 'runs'}", "--set", f"budget.max_steps={STEPS}", "--report", str(report),
           "--timeout", "300"]
    with open(out, "w") as f:
        cli = subprocess.Popen(cmd, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=die_with_parent())
    pointer, run_dir = tmp_path / ".flywheel" / "current.json", None
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 200
        while True:  # wait for training to be under way
            assert cli.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start\n" + out.read_text()[-3000:]
            if pointer.exists():
                state = json.loads(pointer.read_text())
                run_dir = Path(state["run_dir"])
                st = _status(state)
                if st and st["policy_version"] >= KILL_AT:
                    break
            time.sleep(0.5)
        victim = state["services"]["scheduler"]
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        try:
            rc = cli.wait(240)
        except subprocess.TimeoutExpired:
            logs = "".join(f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                           for p in sorted((run_dir / "logs").glob("*.out")))
            if os.environ.get("FLYWHEEL_TEST_KEEP_LOGS"):  # the whole logs, for a hang's post-mortem
                import shutil
                shutil.copytree(run_dir / "logs", os.environ["FLYWHEEL_TEST_KEEP_LOGS"], dirs_exist_ok=True)
            raise AssertionError("the run did not end 240 s after the kill\n" + out.read_text()[-3000:] + logs) from None
        log = out.read_text()
        print(f"killed the scheduler at v{st['policy_version']} {t_kill - t0:.1f} s after the start; the run ended "
              f"{time.monotonic() - t_kill:.1f} s later;",
              *[line for line in log.splitlines() if "scheduler" in line and ("unreachable" in line or "again" in line)])
        assert rc == 0, log[-4000:]
    finally:
        if cli.poll() is None:
            os.kill(cli.pid, signal.SIGTERM)  # the CLI stops its services by pid
            cli.wait(60)
    rep = json.loads(report.read_text())
    assert rep["steps"] == STEPS and [h["step"] for h in rep["history"]] == list(range(1, STEPS + 1)), rep["steps"]
    assert rep["eval"]["after"]["policy_version"] == STEPS
    # peak RSS per process in the report (VmHWM, bytes), the restarted scheduler included
    rss = rep["peak_rss_bytes"]
    assert set(rss) == {"broker", "scheduler", "rollout", "verifier", "trainer", "sandbox"}, rss
    assert all(2**20 < b < 2**35 for b in rss.values()), rss
    cpu = rep["cpu_seconds"]  # CPU seconds per process, both scheduler incarnations summed
    assert set(cpu) == set(rss) and all(0 < c < rep["wall_seconds"] * os.cpu_count() for c in cpu.values()), cpu
    # the CLI said once that it rides through, and that the scheduler came back; the supervisor restarted it
    assert log.count("scheduler unreachable") == 1, log[-4000:]
    assert "scheduler answering again after" in log and str(victim) in log, log[-4000:]
    assert "retrying for up to" in log and "restarted by the supervisor" in log
    # everything stopped
    assert run_dir is not None and not (run_dir / "flywheel.json").exists()
    assert _procs_under(run_dir) == []
