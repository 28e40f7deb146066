"""Workspaces and sessions: a rollout's own copy of a workspace across executions, snapshots and rollback,
ownership across slots, bad archives, expiry, limits, cleanup (the real sandbox, in-process, and once as a
process killed with SIGKILL)."""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from flywheel.broker import free_port, wait_for_port
from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig
from sandbox_service.sessions import PREFIX, remove_stale_sessions

LIST = "import os, json\nprint(json.dumps(sorted(os.path.relpath(os.path.join(d, f), '.') for d, _, fs in os.walk('.') " \
       "for f in fs)))"


def tar_bytes(files: dict[str, bytes], gz: bool = True, extra=None) -> bytes:
    buf = io.BytesIO()
    # gzip's header carries a timestamp: mtime 0 keeps the bytes (and the test ids, digests) the same in every
    # process, which pytest-xdist's workers need to collect the same tests.
    out = gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) if gz else buf
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            t.addfile(info, io.BytesIO(content))
        for info in extra or ():
            t.addfile(info)
    if gz:
        out.close()
    return buf.getvalue()


WORKSPACE = {"README.md": b"# demo\n", "src/app.py": b"def f():\n    return 41\n", "run.sh": b"echo run\n"}


@pytest.fixture(scope="module")
def client():
    """The app with 2 slots, at most 3 sessions, workspaces up to 1 MiB."""
    with TestClient(create_app(SandboxConfig(max_concurrency=2, max_sessions=3, max_workspace_mb=1))) as c:
        yield c
    assert not list(Path("/tmp").glob(f"{PREFIX}{os.getpid()}-*")), "the sessions' tmpfs outlived the service"


def put(c: TestClient, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    r = c.put(f"/v1/workspaces/{digest}", content=body)
    assert r.status_code == 200, r.text
    return digest


@pytest.fixture(scope="module")
def workspace(client) -> str:
    return put(client, tar_bytes(WORKSPACE))


def open_session(c: TestClient, workspace: str | None, **kw) -> str:
    r = c.post("/v1/sessions", json={"workspace": workspace, **kw})
    assert r.status_code == 201, r.text
    assert r.json()["workspace"] == workspace and r.json()["expires_at"] > time.time()
    return r.json()["session_id"]


def ex(c: TestClient, sid: str, code: str, **kw) -> dict:
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def ok(c: TestClient, sid: str, code: str, **kw) -> str:
    res = ex(c, sid, code, **kw)
    assert res["status"] == "ok", res
    return res["stdout"]


def session_dir(c: TestClient, sid: str) -> Path:
    return Path(c.app.state.sessions.root) / "sessions" / sid


def test_put_is_idempotent_and_get_answers(client, workspace):
    info = client.get(f"/v1/workspaces/{workspace}").json()
    assert info == {"digest": workspace, "files": 3, "bytes": sum(map(len, WORKSPACE.values()))}
    body = tar_bytes(WORKSPACE)
    again = client.put(f"/v1/workspaces/{hashlib.sha256(body).hexdigest()}", content=body)
    assert again.status_code == 200
    plain = tar_bytes(WORKSPACE, gz=False)  # not compressed: detected too
    assert client.get(f"/v1/workspaces/{put(client, plain)}").json()["files"] == 3
    assert client.get(f"/v1/workspaces/{'0' * 64}").status_code == 404


def test_a_session_keeps_its_files_and_another_never_sees_them(client, workspace):
    a, b = open_session(client, workspace), open_session(client, workspace)
    try:
        ok(client, a, "import os\nopen('new.txt', 'w').write('mine')\nos.remove('README.md')\n"
                      "open('src/app.py', 'a').write('# edited\\n')\nos.rename('run.sh', 'go.sh')")
        assert json.loads(ok(client, a, LIST)) == ["go.sh", "new.txt", "src/app.py"]
        assert ok(client, a, "print(open('src/app.py').read(), end='')").endswith("# edited\n")
        assert ok(client, a, "import src.app\nprint(src.app.f() + 1)") == "42\n"  # the workspace imports
        assert json.loads(ok(client, b, LIST)) == ["README.md", "run.sh", "src/app.py"]
        assert "edited" not in ok(client, b, "print(open('src/app.py').read())")
        # the request's files are written into the workspace first, overwriting; /tmp stays fresh per run
        ok(client, a, "open('/tmp/scratch', 'w').write('x')", files={"new.txt": "overwritten", "d/e.txt": "e"})
        assert ok(client, a, "import os\nprint(open('new.txt').read(), open('d/e.txt').read(), os.listdir('/tmp'))") \
            == "overwritten e ['main.py']\n"
        assert ok(client, a, "echo $PWD; ls go.sh", language="bash") == "/work\ngo.sh\n"
    finally:
        for sid in (a, b):
            assert client.delete(f"/v1/sessions/{sid}").status_code == 204


def test_a_rollout_that_deletes_its_whole_workspace_and_rolls_back(client, workspace):
    a, other = open_session(client, workspace), open_session(client, workspace)
    try:
        ok(client, a, "open('notes.txt', 'w').write('keep me')\nimport os\nos.remove('run.sh')")
        assert client.post(f"/v1/sessions/{a}/snapshots").json() == {"snapshot": 1}
        res = ex(client, a, "rm -rf /work/* && ls -A /work | wc -l", language="bash")
        assert (res["status"], res["stdout"]) == ("ok", "0\n"), res
        assert json.loads(ok(client, a, LIST)) == []
        assert json.loads(ok(client, other, LIST)) == ["README.md", "run.sh", "src/app.py"]  # never saw it
        t0 = time.perf_counter()
        r = client.post(f"/v1/sessions/{a}/rollback", json={"snapshot": 1})
        assert (r.status_code, r.json()) == (200, {"snapshot": 1}) and time.perf_counter() - t0 < 1.0
        assert json.loads(ok(client, a, LIST)) == ["README.md", "notes.txt", "src/app.py"]
        assert ok(client, a, "print(open('notes.txt').read(), open('src/app.py').read(), end='')") \
            == "keep me def f():\n    return 41\n"
        # the restored files stay writable by the next runs
        ok(client, a, "open('notes.txt', 'a').write('!')\nopen('src/app.py', 'a').write('#')")
        assert ok(client, a, "print(open('notes.txt').read())") == "keep me!\n"
    finally:
        for sid in (a, other):
            client.delete(f"/v1/sessions/{sid}")


def test_rollback_to_zero_after_several_snapshots_drops_the_later_ones(client, workspace):
    sid = open_session(client, workspace)
    try:
        for k in (1, 2, 3):
            ok(client, sid, f"open('v{k}', 'w').write('{k}')")
            assert client.post(f"/v1/sessions/{sid}/snapshots").json() == {"snapshot": k}
        assert client.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 2}).status_code == 200
        assert json.loads(ok(client, sid, LIST)) == ["README.md", "run.sh", "src/app.py", "v1", "v2"]
        r = client.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 3})
        assert r.status_code == 404 and "no snapshot 3" in r.json()["detail"]
        assert client.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 0}).status_code == 200
        assert json.loads(ok(client, sid, LIST)) == ["README.md", "run.sh", "src/app.py"]
        assert client.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 1}).status_code == 404
        assert client.post(f"/v1/sessions/{sid}/snapshots").json() == {"snapshot": 1}  # numbering goes on from 0
        r = client.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": -1})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "snapshot"
    finally:
        client.delete(f"/v1/sessions/{sid}")


def test_files_made_on_one_slot_are_writable_on_another(client):
    sid = open_session(client, None)
    code = ("import os\nos.makedirs('d', exist_ok=True)\nwith open('d/log', 'a') as f: f.write(f'{os.getuid()}\\n')\n"
            "os.chmod('d/log', 0o600)\nos.chmod('d', 0o700)\nopen(f'd/by-{os.getuid()}', 'w').close()\n"
            "print(os.getuid())")
    try:
        uids = []
        with concurrent.futures.ThreadPoolExecutor(4) as busy:  # keep the other slot busy now and then
            for i in range(12):
                blocker = busy.submit(client.post, "/v1/execute", json={"code": "import time; time.sleep(0.2)"}) \
                    if i % 2 else None
                res = ex(client, sid, code)
                assert res["status"] == "ok", res
                uids.append(int(res["stdout"]))
                if blocker:
                    blocker.result()
                if len(set(uids)) > 1 and i >= 3:
                    break
        assert len(set(uids)) > 1, f"every run landed on one slot: {uids}"
        assert ok(client, sid, "print(open('d/log').read(), end='')").split() == [str(u) for u in uids]
    finally:
        client.delete(f"/v1/sessions/{sid}")


def test_executions_of_one_session_run_one_at_a_time(client):
    sid = open_session(client, None)
    code = ("import os, time\nn = int(open('n').read()) if os.path.exists('n') else 0\ntime.sleep(0.2)\n"
            "open('n', 'w').write(str(n + 1))")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: ex(client, sid, code), range(3)))
        assert all(r["status"] == "ok" for r in results), results
        assert ok(client, sid, "print(open('n').read())") == "3\n"
    finally:
        client.delete(f"/v1/sessions/{sid}")


def _member(name: str, kind: bytes, **kw) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return info


@pytest.mark.parametrize("body, words", [
    (tar_bytes({"../x": b"x"}), "'..'"),
    (tar_bytes({"/etc/x": b"x"}), "absolute"),
    (tar_bytes({}, extra=[_member("link", tarfile.SYMTYPE, linkname="/etc/shadow")]), "symlink"),
    (tar_bytes({"a": b"a"}, extra=[_member("hard", tarfile.LNKTYPE, linkname="a")]), "hard link"),
    (tar_bytes({}, extra=[_member("dev", tarfile.CHRTYPE, devmajor=1, devminor=3)]), "device"),
    (tar_bytes({"big": b"\0" * (2 * 2**20)}), "more than"),
    (b"not a tar archive at all", "not a tar archive"),
    (tar_bytes({"/".join(["d"] * 300) + "/f": b"x"}), "nested deeper"),
], ids=["dotdot", "absolute", "symlink", "hardlink", "device", "too-big", "not-tar", "too-deep"])
def test_bad_workspaces_are_422_naming_the_member(client, body, words):
    r = client.put(f"/v1/workspaces/{hashlib.sha256(body).hexdigest()}", content=body)
    assert r.status_code == 422, r.text
    assert words in r.json()["detail"][0]["msg"] and r.json()["detail"][0]["loc"] == ["body"]
    assert not list((Path(client.app.state.sessions.root) / "templates").glob("*.partial-*"))


def test_bad_requests(client, workspace):
    body = tar_bytes({"a": b"a"})
    r = client.put(f"/v1/workspaces/{'a' * 64}", content=body)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "digest"]
    assert client.put("/v1/workspaces/ABC", content=body).status_code == 422
    unknown = hashlib.sha256(b"never put").hexdigest()
    r = client.post("/v1/sessions", json={"workspace": unknown})
    assert r.status_code == 404 and unknown in r.json()["detail"]
    r = client.post("/v1/sessions", json={"workspace": workspace, "ttl_s": 7200})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "ttl_s"
    for path in ("execute", "snapshots", "rollback"):
        r = client.post(f"/v1/sessions/nope/{path}", json={"code": "print(1)"} if path == "execute" else {"snapshot": 0})
        assert r.status_code == 404 and "unknown session 'nope'" in r.json()["detail"], r.text
    assert client.delete("/v1/sessions/nope").status_code == 404


def test_max_sessions_is_503(client):
    sids = [open_session(client, None) for _ in range(3)]
    try:
        r = client.post("/v1/sessions", json={})
        assert r.status_code == 503 and "max_sessions" in r.json()["detail"]
        assert client.get("/healthz").json()["sessions"]["open"] == 3
        assert "flywheel_sandbox_sessions_open 3.0" in client.get("/metrics").text
    finally:
        for sid in sids:
            client.delete(f"/v1/sessions/{sid}")
    r = client.post("/v1/sessions", json={})
    assert r.status_code == 201  # room again
    client.delete(f"/v1/sessions/{r.json()['session_id']}")


def test_ttl_expiry_and_delete_remove_the_files(client, workspace):
    short, deleted = open_session(client, workspace, ttl_s=1.0), open_session(client, workspace)
    ok(client, short, "open('x', 'w').write('x' * 100000)")
    ok(client, deleted, "open('x', 'w').write('x' * 100000)")
    dirs = [session_dir(client, s) for s in (short, deleted)]
    assert all(d.is_dir() for d in dirs)
    assert client.delete(f"/v1/sessions/{deleted}").status_code == 204
    assert not dirs[1].exists()
    r = client.post(f"/v1/sessions/{deleted}/execute", json={"code": "print(1)"})
    assert r.status_code == 404 and "deleted" in r.json()["detail"]
    time.sleep(1.8)  # past ttl_s: the reaper ends it
    assert not dirs[0].exists()
    r = client.post(f"/v1/sessions/{short}/execute", json={"code": "print(1)"})
    assert r.status_code == 404 and "expired" in r.json()["detail"]
    for _ in range(50):  # the trash is emptied in the background
        if not any((Path(client.app.state.sessions.root) / "trash").iterdir()):
            break
        time.sleep(0.1)
    assert not any((Path(client.app.state.sessions.root) / "trash").iterdir())


def test_a_session_over_its_disk_limit_is_ended(client):
    sid = open_session(client, None, disk_mb=1)
    ok(client, sid, "open('big', 'wb').write(b'x' * 3_000_000)")
    r = client.post(f"/v1/sessions/{sid}/execute", json={"code": "print(1)"})
    assert r.status_code == 404 and "disk limit" in r.json()["detail"]
    assert not session_dir(client, sid).exists()


def test_a_workspace_nested_too_deep_ends_its_session_not_the_service(client):
    """The walks hold one descriptor per level: past 256 levels the session is ended (its own doing), and the
    service and its breaker are untouched."""
    sid = open_session(client, None)
    ok(client, sid, "import os\nos.makedirs('/'.join(['d'] * 300))")
    r = client.post(f"/v1/sessions/{sid}/execute", json={"code": "print(1)"})
    assert r.status_code == 404 and "cannot be walked" in r.json()["detail"], r.text
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["breaker"]["state"] == "closed"


def test_symlinks_to_host_files_are_never_followed(client, tmp_path):
    """A run links host paths into its workspace; the walks (snapshot, the next run's hand-over) and the writing
    of request files must neither chown, chmod nor write them."""
    host = tmp_path / "host-secret"
    host.write_text("secret")
    os.chmod(host, 0o600)
    os.chmod(tmp_path, 0o755)
    hdir = tmp_path / "hostdir"
    hdir.mkdir(mode=0o700)
    before = {p: os.stat(p) for p in (host, hdir, "/etc/shadow", "/etc")}
    sid = open_session(client, None)
    try:
        ok(client, sid, f"import os\nos.symlink('{host}', 'f')\nos.symlink('/etc/shadow', 'shadow')\n"
                        f"os.symlink('{hdir}', 'dirlink')\nos.symlink('/etc', 'etc')\nos.mkdir('sub')\n"
                        f"os.symlink('{host}', 'sub/f')")
        assert client.post(f"/v1/sessions/{sid}/snapshots").status_code == 201
        ok(client, sid, "print(1)")  # a new run hands the workspace to its slot uid
        for files in ({"f": "pwned"}, {"dirlink/x": "pwned"}, {"etc/x": "pwned"}, {"sub/f": "pwned"}):
            res = ex(client, sid, "print(1)", files=files)
            assert res["status"] == "runtime_error" and "not a directory" in res["stderr"], res
        assert client.post(f"/v1/sessions/{sid}/snapshots").status_code == 201
    finally:
        client.delete(f"/v1/sessions/{sid}")
    assert host.read_text() == "secret" and not (hdir / "x").exists() and not Path("/etc/x").exists()
    for p, st in before.items():
        now = os.stat(p)
        assert (now.st_uid, now.st_gid, now.st_mode, now.st_mtime_ns) == (st.st_uid, st.st_gid, st.st_mode,
                                                                          st.st_mtime_ns), p


def test_session_files_do_not_take_the_slot_memory_of_later_runs():
    """Session files on the tmpfs stay charged to the slot (memory cgroup) that wrote them; later runs on that
    slot get their own memory_mb on top, never a failed set-up."""
    with TestClient(create_app(SandboxConfig(max_concurrency=1))) as c:
        sid = open_session(c, None, disk_mb=200)
        res = ex(c, sid, "open('big', 'wb').write(b'x' * 90 * 2**20)", disk_mb=128, memory_mb=256)
        assert res["status"] == "ok", res
        for _ in range(2):
            res = c.post("/v1/execute", json={"code": "x = bytearray(16 * 2**20)\nprint('ok')", "memory_mb": 64}).json()
            assert (res["status"], res["attempts"]) == ("ok", 1), res
            assert res["peak_memory_bytes"] is None or res["peak_memory_bytes"] < 64 * 2**20, res
        assert ok(c, sid, "import os\nprint(os.path.getsize('big'))", memory_mb=32) == f"{90 * 2**20}\n"


def test_without_namespaces_sessions_are_501():
    with TestClient(create_app(SandboxConfig(max_concurrency=1, allow_degraded=True,
                                             disable_layers=["namespaces"]))) as c:
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 501 and "namespaces" in r.json()["detail"]
        assert c.get(f"/v1/workspaces/{'0' * 64}").status_code == 501
        assert c.get("/healthz").json()["sessions"]["available"] is False


@pytest.mark.e2e  # kills a service process: the whole-system tier (pyproject's markers)
def test_a_killed_services_session_files_are_removed_at_the_next_start(tmp_path):
    port = free_port()
    env = {**os.environ, "FLYWHEEL_SANDBOX__PORT": str(port), "FLYWHEEL_SANDBOX__MAX_CONCURRENCY": "1",
           "FLYWHEEL_RUN__DIR": str(tmp_path)}
    for k in ("FLYWHEEL_CONFIG", "FLYWHEEL_AUTH__TOKEN", "FLYWHEEL_AUTH__TOKEN_FILE"):
        env.pop(k, None)
    log = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_service"], env=env, stdout=log, stderr=subprocess.STDOUT)
    worker_pids: list[int] = []
    try:
        wait_for_port("127.0.0.1", port, timeout_s=60)
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {(tmp_path / 'auth_token').read_text().strip()}"}
        body = tar_bytes({"f": uuid.uuid4().bytes})
        digest = hashlib.sha256(body).hexdigest()
        assert httpx.put(f"{base}/v1/workspaces/{digest}", content=body, timeout=30).status_code == 401
        assert httpx.put(f"{base}/v1/workspaces/{digest}", content=body, headers=auth, timeout=30).status_code == 200
        sid = httpx.post(f"{base}/v1/sessions", json={"workspace": digest}, headers=auth, timeout=30).json()["session_id"]
        res = httpx.post(f"{base}/v1/sessions/{sid}/execute", json={"code": "open('g', 'w').write('g')"},
                         headers=auth, timeout=30).json()
        assert res["status"] == "ok", res
        worker_pids = httpx.get(f"{base}/healthz", timeout=10).json()["workers"]["pids"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    left = list(Path("/tmp").glob(f"{PREFIX}{proc.pid}-*"))
    assert len(left) == 1 and (left[0] / "sessions" / sid / "upper" / "g").exists()
    deadline = time.monotonic() + 15  # its workers see their pipe close and end
    while any(Path(f"/proc/{p}").exists() for p in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert remove_stale_sessions() >= 1  # what the next service's start-up runs first
    assert not left[0].exists()
    assert str(left[0]) not in Path("/proc/self/mounts").read_text()
