"""Hostile code against the sandbox: the service and the host stay unharmed (a later issue hardens more)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig
from sandbox_service.executor import drop_to_uid

pytestmark = pytest.mark.skipif(drop_to_uid(SandboxConfig()) is None,
                                reason="needs root and util-linux setpriv to run code as an unprivileged uid")


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(SandboxConfig(max_concurrency=2))) as c:
        yield c


def run(client, code, **kw):
    r = client.post("/v1/execute", json={"code": code, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_killing_the_parent_does_not_kill_the_service(client):
    res = run(client, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time; time.sleep(5)",
              timeout_s=3)
    assert res["status"] in ("killed", "timeout", "runtime_error")
    assert client.get("/healthz").status_code == 200
    assert run(client, "print(1)")["stdout"] == "1\n"


def test_code_runs_unprivileged_and_cannot_read_shadow_or_write_service_files(client, tmp_path):
    target = tmp_path / "owned-by-root.txt"
    target.write_text("keep")
    code = (f"import os\nprint(os.getuid())\n"
            f"try:\n    open('/etc/shadow').read(); print('SHADOW')\nexcept PermissionError: print('denied')\n"
            f"try:\n    open({str(target)!r}, 'w').write('x'); print('WROTE')\nexcept OSError: print('denied')\n")
    res = run(client, code)
    assert res["stdout"].split() == ["65534", "denied", "denied"], res
    assert target.read_text() == "keep"


def test_fork_bomb_is_bounded_and_service_survives(client):
    code = ("import os\nn = 0\nfor _ in range(1000):\n    try:\n        if os.fork() == 0:\n"
            "            import time; time.sleep(30); os._exit(0)\n        n += 1\n    except OSError:\n"
            "        break\nprint(n)")
    res = run(client, code, timeout_s=5)
    assert res["status"] == "ok"
    assert int(res["stdout"]) < 100  # RLIMIT_NPROC of the unprivileged uid
    assert client.get("/healthz").status_code == 200
