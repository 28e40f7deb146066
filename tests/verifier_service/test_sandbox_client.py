"""The verifier's and the rollout's calls to the real sandbox (``python -m sandbox_service`` in a subprocess,
stopped by pid) ride through a sandbox that starts late or is killed -9 and restarted, send the token, and
stay an infrastructure error (never a score) when the sandbox stays down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel.broker import free_port
from rollout_service.tool_loop import ToolRunner
from shared.client import SANDBOX_RETRY_S
from shared.schemas import Task
from shared.verifier_specs import UnitTestsSpec
from verifier_service.config import VerifierConfig
from verifier_service import scorers
from verifier_service.scorers import Scorer

TOKEN = "s" * 32
ROOT = Path(__file__).resolve().parents[2]
SPEC = UnitTestsSpec(tests="def check(f):\n    assert f() == 1\n", entry_point="f")
ANSWER = "```python\ndef f():\n    return 1\n```"


class Sandbox:
    """The sandbox service on a fixed free port, with token ``TOKEN``, started after ``delay_s``."""

    def __init__(self, run_dir: Path) -> None:
        self.port, self.run_dir = free_port(), run_dir
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def start(self, delay_s: float = 0.0) -> subprocess.Popen:
        env = dict(os.environ, FLYWHEEL_SANDBOX__PORT=str(self.port), FLYWHEEL_RUN__DIR=str(self.run_dir),
                   FLYWHEEL_AUTH__TOKEN=TOKEN, PYTHONPATH=str(ROOT))
        # exec: the pid is the sandbox's, so it is stopped by its own pid
        p = subprocess.Popen(["sh", "-c", f'sleep {delay_s}; exec "{sys.executable}" -m sandbox_service'],
                             env=env, start_new_session=True, cwd=self.run_dir,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and self.procs[-1].poll() is None, "the sandbox did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(5)


@pytest.fixture
def sandbox(tmp_path):
    s = Sandbox(tmp_path)
    try:
        yield s
    finally:
        s.stop()
    assert all(p.poll() is not None for p in s.procs)


async def test_the_verifier_scores_through_a_sandbox_that_starts_late(sandbox):
    sandbox.start(delay_s=1.5)  # nothing listens for 1.5 s plus the sandbox's start-up
    s = Scorer(VerifierConfig(sandbox_url=sandbox.url), token=TOKEN)
    try:
        t0 = time.monotonic()
        r = await s.score(SPEC, ANSWER)
    finally:
        await s.close()
    assert time.monotonic() - t0 >= 1.5
    assert r.infra_error is False and r.total == 1.0, r.details  # the old client: infra_error, refused


async def test_the_verifier_scores_through_a_sandbox_killed_and_restarted(sandbox):
    first = sandbox.start()
    sandbox.wait_healthy()
    s = Scorer(VerifierConfig(sandbox_url=sandbox.url), token=TOKEN)
    try:
        assert (await s.score(SPEC, ANSWER)).total == 1.0
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        sandbox.start(delay_s=1.0)  # the supervisor's restart
        r = await s.score(SPEC, ANSWER)
    finally:
        await s.close()
    assert r.infra_error is False and r.total == 1.0, r.details


async def test_the_tool_loop_runs_a_call_through_a_sandbox_that_starts_late(sandbox):
    sandbox.start(delay_s=1.5)
    task = Task(task_id="t", domain="tools", prompt=[{"role": "user", "content": "x"}],
                verifier={"kind": "regex", "pattern": "."}, tools=["run_python"], max_turns=2)
    runner = ToolRunner(sandbox.url, token=TOKEN)
    try:
        out = await runner.run("run_python", {"code": "print(6*7)"}, task, None)
    finally:
        await runner.close()
    assert "42" in out and "exit code 0" in out, out  # the old client: "error: the sandbox could not run it"


async def test_a_sandbox_that_stays_down_is_an_infra_error_after_the_retry_window(monkeypatch):
    retry_s = 2.5  # the product's window (shared.client.SANDBOX_RETRY_S), shortened: the rule, not the figure
    assert retry_s < SANDBOX_RETRY_S
    monkeypatch.setattr(scorers, "SANDBOX_RETRY_S", retry_s)
    url = f"http://127.0.0.1:{free_port()}"  # nothing ever listens
    s = Scorer(VerifierConfig(sandbox_url=url), token=TOKEN)
    try:
        t0 = time.monotonic()
        r = await s.score(SPEC, ANSWER)
        took = time.monotonic() - t0
    finally:
        await s.close()
    assert r.infra_error is True and "correctness" not in r.components  # never a 0 pass
    assert "unreachable" in r.details["reason"] and "ConnectError" in r.details["reason"]
    assert r.details["http_attempts"] >= 3
    assert retry_s - 0.5 <= took < retry_s + 5, took


async def test_the_token_is_sent_to_the_sandbox_and_a_wrong_one_is_an_infra_error(sandbox):
    sandbox.start()
    sandbox.wait_healthy()
    good = Scorer(VerifierConfig(sandbox_url=sandbox.url), token=lambda: TOKEN)
    bad = Scorer(VerifierConfig(sandbox_url=sandbox.url), token="wrong-token-" * 3)
    try:
        assert (await good.score(SPEC, ANSWER)).total == 1.0
        r = await bad.score(SPEC, ANSWER)
    finally:
        await good.close()
        await bad.close()
    r_auth = httpx.post(f"{sandbox.url}/v1/execute", json={"code": "print(1)"}, timeout=10).status_code
    if r_auth == 401:  # the sandbox checks the token
        assert r.infra_error is True and "401" in r.details["reason"], r.details
    else:  # a sandbox without the check: the wrong token is simply ignored
        assert r.total == 1.0
