"""Sandbox service against its real executor: limits, isolation, HTTP contract."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig


@pytest.fixture(scope="module")
def client():
    """The app with lifespan (isolation probe) run, default limits, 2 slots."""
    with TestClient(create_app(SandboxConfig(max_concurrency=2))) as c:
        yield c


def run(client: TestClient, code: str, **kw) -> dict:
    r = client.post("/v1/execute", json={"code": code, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_hello_world_ok(client):
    res = run(client, "print('hello world')")
    assert res["status"] == "ok"
    assert res["exit_code"] == 0
    assert res["stdout"] == "hello world\n"
    assert res["stderr"] == ""
    assert not res["stdout_truncated"] and not res["stderr_truncated"]
    assert res["run_id"] and res["wall_s"] > 0
    assert res["degraded"] == ([] if res["network_isolated"] else ["network"])


def test_stdin_and_files(client):
    res = run(client, "import sys\nprint(sys.stdin.read().upper(), open('data/in.txt').read())",
              stdin="abc", files={"data/in.txt": "xyz"})
    assert res["status"] == "ok", res
    assert res["stdout"] == "ABC xyz\n"


def test_runtime_error(client):
    res = run(client, "import sys\nprint('before')\nraise ValueError('boom')")
    assert res["status"] == "runtime_error"
    assert res["exit_code"] == 1
    assert res["stdout"] == "before\n"
    assert "ValueError: boom" in res["stderr"]
    res = run(client, "import sys; sys.exit(7)")
    assert (res["status"], res["exit_code"]) == ("runtime_error", 7)


def test_infinite_loop_times_out(client):
    t0 = time.monotonic()
    res = run(client, "while True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert res["status"] == "timeout"
    assert res["exit_code"] is not None and res["exit_code"] < 0
    assert 0.9 <= res["wall_s"] < 3.0
    assert elapsed < 3.0


def test_sleeping_child_times_out(client):
    res = run(client, "import time\ntime.sleep(30)", timeout_s=0.5)
    assert res["status"] == "timeout"
    assert res["wall_s"] < 2.5


def test_memory_limit(client):
    res = run(client, "x = bytearray(4 * 2**30)\nprint('allocated')", memory_mb=256)
    assert res["status"] == "memory_limit", res
    assert "MemoryError" in res["stderr"]
    assert "allocated" not in res["stdout"]


def test_output_capped_and_flagged(client):
    res = run(client, "import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stdout.flush()", output_limit_bytes=4096)
    assert res["status"] == "output_limit"
    assert res["stdout_truncated"] is True
    assert res["stderr_truncated"] is False
    assert res["stdout"] == "x" * 4096


def test_output_just_under_cap_is_not_truncated(client):
    res = run(client, "print('y' * 999, end='')", output_limit_bytes=1000)
    assert res["status"] == "ok"
    assert res["stdout_truncated"] is False and len(res["stdout"]) == 999


def test_cwd_private_empty_and_removed(client):
    code = ("import os, json\nprint(json.dumps([os.getcwd(), sorted(os.listdir('.')), sorted(os.listdir('/tmp')), "
            "os.environ['HOME']]))\nopen('junk', 'w').write('x'); open('/tmp/junk', 'w').write('x')")
    first = run(client, code)
    second = run(client, code)
    assert first["status"] == "ok" and second["status"] == "ok", (first, second)
    cwd1, work1, tmp1, home1 = json.loads(first["stdout"])
    cwd2, work2, tmp2, _ = json.loads(second["stdout"])
    assert work1 == work2 == ["main.py"] and tmp1 == tmp2 == []  # the previous run's files are gone
    assert cwd1 == cwd2 == home1 == "/work"
    assert not Path("/work/junk").exists() and not Path("/tmp/junk").exists()  # never on the host


def test_env_does_not_leak(client, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_SECRET_TOKEN", "hunter2")
    res = run(client, "import os, json\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(res["stdout"])
    assert "FLYWHEEL_SECRET_TOKEN" not in env
    assert "hunter2" not in res["stdout"]
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}


def test_missing_code_is_422_naming_field(client):
    r = client.post("/v1/execute", json={"stdin": "x"})
    assert r.status_code == 422
    assert any(e["loc"][-1] == "code" for e in r.json()["detail"])


def test_wrong_timeout_type_is_422_naming_field(client):
    r = client.post("/v1/execute", json={"code": "print(1)", "timeout_s": "soon"})
    assert r.status_code == 422
    assert any(e["loc"][-1] == "timeout_s" for e in r.json()["detail"])


def test_lone_surrogate_is_422_naming_the_field(client):
    """Valid JSON, not UTF-8 text: a 422 naming where it is, not a 500 or an infra_error."""
    import json

    body = json.dumps({"code": "print(1)", "files": {"data.txt": "x\ud800"}})
    r = client.post("/v1/execute", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert "files.data.txt" in r.json()["detail"][0]["msg"]
    body = json.dumps({"code": "print(1)", "files": {"\ud800": "x"}})  # in a key: the message escapes it
    r = client.post("/v1/execute", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "files.\\ud800" in r.json()["detail"][0]["msg"], r.text


@pytest.mark.parametrize("body,field", [
    ({"code": ""}, "code"),
    ({"code": "1", "language": "ruby"}, "language"),
    ({"code": "1", "files": {"../escape.py": "x"}}, "files"),
    ({"code": "1", "files": {"/etc/passwd": "x"}}, "files"),
    ({"code": "1", "unknown": 1}, "unknown"),
    ({"code": "1", "timeout_s": -1}, "timeout_s"),
    ({"code": "1", "files": {"a": "x", "a/b": "y"}}, "files"),  # a file cannot also be a directory
    ({"code": "1", "files": {"a/b": "x", "./a/b": "y"}}, "files"),  # two names, one file
    ({"code": "1", "files": {"a" * 300: "x"}}, "files"),  # longer than a file name can be
    ({"code": "print(1)\x00import os", "files": {}}, "code"),  # Python would stop reading at the NUL
])
def test_invalid_bodies_are_422(client, body, field):
    r = client.post("/v1/execute", json=body)
    assert r.status_code == 422, r.text
    assert any(field in e["loc"] for e in r.json()["detail"]), r.json()


def test_healthz_counts_runs():
    with TestClient(create_app(SandboxConfig())) as c:
        before = c.get("/healthz").json()
        assert before["status"] == "ok"
        assert before["runs"]["ok"] == 0
        assert isinstance(before["network_isolated"], bool)
        run(c, "print(1)")
        run(c, "raise SystemExit(2)")
        after = c.get("/healthz").json()["runs"]
        assert after["ok"] == 1 and after["runtime_error"] == 1


def test_bad_interpreter_refuses_to_start():
    with pytest.raises(RuntimeError, match="no worker started"):
        with TestClient(create_app(SandboxConfig(python="/nonexistent/python3"))):
            pass


TOKEN = "sandbox-test-token-0123456789abcdef"


def test_execute_needs_the_token_when_the_app_has_one():
    """Any local process could run code in the sandbox. With a token (what
    ``sandbox_service.main`` always passes), ``POST /v1/execute`` (and every other ``/v1/`` route) answers 401
    without it; /healthz and /metrics stay open."""
    from shared.auth import SCHEME_NAME, auth_headers

    app = create_app(SandboxConfig(max_concurrency=1), auth_token=TOKEN)
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer not-the-token-0123456789"}, {"Authorization": TOKEN}):
            r = c.post("/v1/execute", json={"code": "print(1)"}, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, r.text)
        r = c.post("/v1/execute", json={"code": "print(1)"}, headers=auth_headers(TOKEN))
        assert r.status_code == 200 and r.json()["stdout"] == "1\n"
        assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 200
        doc = c.get("/openapi.json").json()
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                # every /v1/ route (executions, workspaces, sessions) needs it; /healthz and /metrics stay open
                assert (op.get("security") == [{SCHEME_NAME: []}]) == path.startswith("/v1/"), (method, path)
        assert {"400", "401", "413", "422", "503"} <= set(doc["paths"]["/v1/execute"]["post"]["responses"])


def test_main_builds_the_app_with_the_servers_token(tmp_path, monkeypatch):
    """``sandbox_service.main`` passes ``server_token(auth, run)``: a token file in the run directory, mode 0600."""
    import inspect

    import sandbox_service.main as main
    from shared.auth import server_token
    from shared.config import RunConfig
    from sandbox_service.config import SandboxSettings

    settings = SandboxSettings(run=RunConfig(dir=str(tmp_path)))
    token = server_token(settings.auth, settings.run)
    assert (tmp_path / "auth_token").read_text().strip() == token
    assert (tmp_path / "auth_token").stat().st_mode & 0o077 == 0
    assert "auth_token=server_token(config.auth, config.run)" in inspect.getsource(main.run)


def test_chunked_body_over_the_limit_is_413_and_bad_json_400_naming_where(client):
    """A body without Content-Length was refused with 411; now it is counted while received (413 past the
    limit, served otherwise). Invalid UTF-8 and deep nesting get a 400 that says what and where."""
    cfg = SandboxConfig(max_concurrency=1, max_request_bytes=4096)
    with TestClient(create_app(cfg)) as c:
        big = json.dumps({"code": "print(1)", "stdin": "x" * 10_000}).encode()
        r = c.post("/v1/execute", content=iter([big[i:i + 1000] for i in range(0, len(big), 1000)]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        small = json.dumps({"code": "print(2)"}).encode()
        r = c.post("/v1/execute", content=iter([small]), headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["stdout"] == "2\n", r.text
    r = client.post("/v1/execute", content=b'{"code": "print(\xc3(1)"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid UTF-8: byte 16" in r.text, r.text
    r = client.post("/v1/execute", content=b'{"code": "1", "files": ' + b"[" * 100 + b"]" * 100 + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "deeper than 64 levels at $.files" in r.text, r.text


def test_a_huge_invalid_body_is_not_echoed(client):
    """A 64 MB invalid body came back whole in the 422; now an excerpt of 200 characters."""
    r = client.post("/v1/execute", json={"code": 7, "stdin": ["x" * 1_000_000]})
    assert r.status_code == 422 and len(r.content) < 3000, len(r.content)
    assert "characters)" in r.text
