"""Without a working `unshare --net` the sandbox says it is degraded, or refuses to start when told to."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from sandbox_service import executor
from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig


@pytest.fixture
def no_unshare(monkeypatch):
    monkeypatch.setattr(executor, "_probe_cache", {})
    monkeypatch.setattr(executor, "unshare_binary", lambda: None)


def test_degraded_runs_are_flagged(no_unshare):
    with TestClient(create_app(SandboxConfig())) as c:
        assert c.get("/healthz").json()["network_isolated"] is False
        res = c.post("/v1/execute", json={"code": "print('still runs')"}).json()
    assert res["status"] == "ok"
    assert res["stdout"] == "still runs\n"
    assert res["network_isolated"] is False
    assert res["degraded"] == ["network"]


def test_required_isolation_refuses_to_start(no_unshare):
    app = create_app(SandboxConfig(require_network_isolation=True))
    with pytest.raises(RuntimeError, match="network isolation"):
        with TestClient(app):
            pass
