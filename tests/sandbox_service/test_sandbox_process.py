"""``python -m sandbox_service`` as a real process: serves, executes, stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from flywheel.broker import free_port, wait_for_port


def test_module_serves_and_stops_on_sigterm(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "FLYWHEEL_SANDBOX__PORT": str(port),
        "FLYWHEEL_SANDBOX__HOST": "127.0.0.1",
        "FLYWHEEL_RUN__DIR": str(tmp_path),
    }
    for k in ("FLYWHEEL_CONFIG", "FLYWHEEL_AUTH__TOKEN", "FLYWHEEL_AUTH__TOKEN_FILE"):
        env.pop(k, None)
    log = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_service"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, timeout_s=30)
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/healthz", timeout=10).json()
        assert health["status"] == "ok"
        assert httpx.post(f"{base}/v1/execute", json={"code": "print(6 * 7)"}, timeout=30).status_code == 401
        token = (tmp_path / "auth_token").read_text().strip()  # written by the service at start-up, mode 0600
        assert (tmp_path / "auth_token").stat().st_mode & 0o777 == 0o600
        res = httpx.post(f"{base}/v1/execute", json={"code": "print(6 * 7)"}, timeout=30,
                         headers={"Authorization": f"Bearer {token}"}).json()
        assert res["status"] == "ok"
        assert res["stdout"] == "42\n"
        assert res["network_isolated"] == health["network_isolated"]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM, so -SIGTERM is a clean stop too
    assert rc in (0, -signal.SIGTERM), f"exit code {rc} after SIGTERM"
    assert proc.poll() is not None
    log.seek(0)
    out = log.read()
    assert "Traceback" not in out, out
    # one structured line per run in the service's own log file
    lines = (tmp_path / "logs" / "sandbox.log").read_text().splitlines()
    assert any("status=ok" in line and "run_id=" in line and "wall_s=" in line for line in lines), lines
