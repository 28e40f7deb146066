"""Hostile code against the real sandbox with every isolation layer on: one test per case.

Each test asserts what the program was stopped from doing, and then that the host and the worker
are unharmed (:func:`unharmed`): the same worker processes still serve, no environment failure was
counted, no process of a sandbox uid is left on the host, and a canary run succeeds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig
from sandbox_service.isolation import probe
from sandbox_service.uids import SEARCH

from .test_sandbox_api import run

CFG = SandboxConfig(max_concurrency=2, default_timeout_s=5.0, default_memory_mb=256, default_disk_mb=16)
CAPS = probe()
pytestmark = pytest.mark.skipif(bool(CAPS.problems), reason=f"full isolation unavailable here: {CAPS.problems}")


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(CFG, CAPS)) as c:
        yield c


def sandbox_uid_processes() -> dict[int, str]:
    """Host processes whose real uid is one of the sandbox slots' uids and that are not another sandbox
    service's: ``{pid: "starttime state cmdline"}``.

    The start time (clock ticks since boot, field 22 of /proc/PID/stat) tells a process apart from a later
    one that reuses its pid (pid_max is 32768 here, so pids wrap during the suite). Another service's slots
    use uids of the same range: the suite's session sandbox (``sandbox_url``) keeps running beside this module, and its
    workers fork their next run's processes whenever they like. Those carry their worker's command line,
    whose ``--slot`` names the service's pid (``<pid>-slot<i>-<hex>``, :class:`sandbox_service.pool.WorkerHandle`),
    and are left out; a process that escaped this module's sandbox never carries another service's slot.
    Zombies (state Z or X) are left out too: they run nothing, and one that has exited but waits for its
    parent to reap it has an empty command line, so it could not be told apart by its slot."""
    lo, hi = CFG.uid_base, CFG.uid_base + SEARCH  # the uids any sandbox service on this host may claim
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                status = (d / "status").read_text().splitlines()
                uid = int(next(l for l in status if l.startswith("Uid:")).split()[1])
                state = next(l for l in status if l.startswith("State:")).split()[1]
                if lo <= uid < hi and state not in ("Z", "X"):  # a zombie runs nothing: it waits to be reaped
                    start = (d / "stat").read_text().rsplit(")", 1)[1].split()[19]
                    argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
                    slot = _slot_of(int(d.name))
                    if slot is not None and not slot.startswith(f"{os.getpid()}-slot"):
                        continue  # another sandbox service's slot
                    found[int(d.name)] = f"{start} {state} {' '.join(argv)[:160]}"
            except (OSError, StopIteration, ValueError, IndexError):
                continue
    return found


def _slot_of(pid: int, depth: int = 16) -> str | None:
    """The ``--slot`` of ``pid``'s command line, else of its nearest ancestor's (a run's child that has exited and
    waits to be reaped, a zombie, has an empty command line: its parent still names the slot); ``None`` if none
    of ``depth`` generations has one."""
    for _ in range(depth):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        if "--slot" in argv[:-1]:
            return argv[argv.index("--slot") + 1]
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        pid = int(next(l for l in status if l.startswith("PPid:")).split()[1])
        if pid <= 1:
            return None
    return None


@pytest.fixture
def unharmed(client):
    """Snapshot the service before the test; after it, assert the host and the workers are unharmed.

    Processes of a sandbox uid that were already running before the test (another sandbox on this host,
    e.g. one a crashed earlier test or a developer left behind) are not this test's: only new ones fail it."""
    before = client.get("/healthz").json()
    already = sandbox_uid_processes()
    yield

    def new() -> dict[int, str]:
        return {pid: what for pid, what in sandbox_uid_processes().items() if already.get(pid) != what}

    deadline = time.monotonic() + 5
    while new() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert new() == {}, "a sandboxed process outlived its run"
    after = client.get("/healthz").json()
    assert after["status"] == "ok", after
    assert after["workers"]["pids"] == before["workers"]["pids"], "a worker died or was replaced"
    assert after["counters"].get("environment_failures", 0) == before["counters"].get("environment_failures", 0)
    canary = run(client, "print('alive')")
    assert (canary["status"], canary["stdout"]) == ("ok", "alive\n"), canary


def test_fork_bomb(client, unharmed):
    res = run(client, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
              timeout_s=2)
    assert res["status"] == "timeout", res
    assert res["wall_s"] < 4


def test_allocate_4_gib(client, unharmed):
    res = run(client, "x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert res["status"] == "memory_limit", res
    assert "allocated" not in res["stdout"]


def test_touch_memory_past_the_limit(client, unharmed):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))\n    print(len(chunks), flush=True)"
    res = run(client, code, memory_mb=128)
    assert res["status"] == "memory_limit", res
    assert res["peak_memory_bytes"] is not None and res["peak_memory_bytes"] <= 130 * 1024**2
    assert int(res["stdout"].split()[-1]) * 16 < 160  # stopped near 128 MiB, not at the host's limit


def test_infinite_loop(client, unharmed):
    res = run(client, "while True:\n    pass", timeout_s=1.5)
    assert res["status"] == "timeout", res
    assert 1.5 <= res["wall_s"] < 3


def test_100_mb_of_output(client, unharmed):
    res = run(client, "import sys\nchunk = 'x' * 1024 * 1024\nfor _ in range(100):\n    sys.stdout.write(chunk)",
              output_limit_bytes=65536)
    assert res["status"] == "output_limit", res
    assert res["stdout_truncated"] and len(res["stdout"]) == 65536
    assert res["wall_s"] < 3


def test_tcp_to_a_host_listener(client, unharmed):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted: list = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(srv.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('CONNECTED')\n"
            "except OSError as e:\n    print('BLOCKED', e.errno)")
    try:
        res = run(client, code)
    finally:
        stop.set()
        t.join(2)
        srv.close()
    assert res["status"] == "ok", res
    assert res["stdout"].startswith("BLOCKED"), res
    assert accepted == []


def test_read_etc_shadow(client, unharmed):
    res = run(client, "print(repr(open('/etc/shadow').read()))")
    assert res["status"] == "ok" and res["stdout"] == "''\n", res  # masked by an empty file
    if Path("/etc/shadow").exists() and Path("/etc/shadow").stat().st_size:
        first_user = Path("/etc/shadow").read_text().split(":")[0]
        assert first_user not in res["stdout"]


def test_read_the_service_environment(client, unharmed, monkeypatch):
    os.environ["FLYWHEEL_TEST_SECRET"] = "hunter2-sandbox"
    try:
        code = ("import os, json, glob\nleaks = []\nfor p in glob.glob('/proc/*/environ'):\n    try:\n"
                "        if b'hunter2' in open(p, 'rb').read(): leaks.append(p)\n    except OSError:\n        pass\n"
                "print(json.dumps({'env': dict(os.environ), 'leaks': leaks, 'pids': sorted(os.listdir('/proc'))}))")
        res = run(client, code)
    finally:
        del os.environ["FLYWHEEL_TEST_SECRET"]
    assert res["status"] == "ok", res
    out = json.loads(res["stdout"])
    assert set(out["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}
    assert out["leaks"] == [] and "hunter2" not in res["stdout"]
    assert str(os.getpid()) not in out["pids"] or os.getpid() == 1  # the service's pid is not visible


def test_write_outside_the_work_dir(client, unharmed, tmp_path):
    target = tmp_path / "planted"
    code = ("import json\nres = {}\n"
            f"for p in ['/usr/planted', '/etc/planted', '/planted', '/dev/planted', '/root/planted', {str(target)!r}]:\n"
            "    try:\n        open(p, 'w').write('x'); res[p] = 'WROTE'\n"
            "    except OSError as e:\n        res[p] = e.errno\nprint(json.dumps(res))")
    res = run(client, code)
    out = json.loads(res["stdout"])
    assert "WROTE" not in out.values(), out
    assert not target.exists() and not Path("/planted").exists() and not Path("/usr/planted").exists()


def test_files_left_for_the_next_run(client, unharmed):
    plant = "open('/work/left.txt', 'w').write('x'); open('/tmp/left.txt', 'w').write('x'); print('ok')"
    assert run(client, plant)["status"] == "ok"
    for _ in range(3):  # whichever worker takes the next runs
        res = run(client, "import os; print(sorted(os.listdir('/work')), sorted(os.listdir('/tmp')))")
        assert res["stdout"] == "['main.py'] []\n", res


def test_kill_the_parent(client, unharmed):
    code = ("import os, signal\nprint(os.getpid(), os.getppid())\n"
            "for pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as e:\n        print('denied', pid, e.errno)\nprint('survived')")
    res = run(client, code)
    lines = res["stdout"].splitlines()
    assert lines[0] == "2 1", res  # its parent is the sandbox's own init (pid 1 of the run's namespace)
    assert lines[1:4] == ["denied 1 1", "denied 1 1", "denied -1 3"], res  # EPERM, EPERM, ESRCH: nobody to kill
    assert lines[-1] == "survived"


def test_daemonised_child_outlives_its_parent(client, unharmed):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(60)\n    os._exit(0)\nprint('parent done')")
    res = run(client, code)
    assert res["status"] == "ok" and res["stdout"] == "parent done\n", res
    # the fixture asserts no process of a sandbox uid is left on the host


@pytest.mark.parametrize("call", [
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.ptrace(16, 1, 0, 0)",
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.unshare(0x10000000)",
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.unshare(0x40000000)",
])
def test_ptrace_mount_unshare(client, unharmed, call):
    res = run(client, call + "\nprint(r, ctypes.get_errno())")
    assert res["status"] == "ok", res
    r, err = res["stdout"].split()
    assert r == "-1" and int(err) == 1, res  # EPERM


def test_fill_the_disk(client, unharmed):
    code = ("import errno\nn = 0\ntry:\n    with open('/work/big', 'wb') as f:\n        while True:\n"
            "            f.write(b'x' * 1024 * 1024); f.flush(); n += 1\nexcept OSError as e:\n"
            "    print('stopped', n, errno.errorcode[e.errno])")
    res = run(client, code, disk_mb=8)
    assert "stopped" in res["stdout"] or res["status"] in ("runtime_error", "killed"), res
    if "stopped" in res["stdout"]:
        assert int(res["stdout"].split()[1]) <= 8


def test_setuid_binaries(client, unharmed):
    code = ("import os, subprocess\nfor cmd in (['su', '-c', 'id'], ['sudo', 'id']):\n    try:\n"
            "        p = subprocess.run(cmd, capture_output=True, timeout=3, stdin=subprocess.DEVNULL)\n"
            "        print(cmd[0], p.returncode)\n    except (OSError, subprocess.TimeoutExpired) as e:\n"
            "        print(cmd[0], 'failed', type(e).__name__)\n"
            "try:\n    os.setuid(0)\n    print('ROOT')\nexcept OSError as e:\n    print('setuid', e.errno)\n"
            "print('uid', os.getuid(), os.geteuid())")
    res = run(client, code)
    assert res["status"] == "ok", res
    assert "ROOT" not in res["stdout"]
    for line in res["stdout"].splitlines():
        if line.startswith(("su ", "sudo ")):
            assert line.split()[1] != "0", res  # no setuid binary gave it root
    uid_line = res["stdout"].splitlines()[-1].split()
    assert int(uid_line[1]) >= CFG.uid_base and int(uid_line[2]) >= CFG.uid_base


def test_sysv_shared_memory_does_not_outlive_the_run(client, unharmed):
    """System V IPC lives in the run's own IPC namespace: a segment left behind is gone for the next run
    (the break-it pass carried data between runs, and pinned memory, with one)."""
    plant = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
             "sid = libc.shmget(0x1234, 1 << 20, 0o1666)\naddr = libc.shmat(sid, None, 0)\n"
             "ctypes.memmove(addr, b'SECRET', 6)\nprint(sid >= 0)")
    assert run(client, plant)["stdout"] == "True\n"
    for _ in range(3):  # whichever worker takes the next runs
        res = run(client, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                          "print(libc.shmget(0x1234, 0, 0), open('/proc/sysvipc/shm').read().count('\\n'))")
        assert res["stdout"] == "-1 1\n", res  # no such segment; the table has only its header line


def test_signals_to_itself_work_as_usual(client, unharmed):
    """The program is not its namespace's init, so signals it sends itself are not ignored."""
    assert run(client, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\nprint('alive')")["exit_code"] == -9
    res = run(client, "import signal, time\nsignal.alarm(1)\ntime.sleep(3)\nprint('alive')")
    assert (res["status"], res["exit_code"], res["stdout"]) == ("killed", -signal.SIGALRM, ""), res


def test_big_output_with_little_memory_is_not_an_environment_failure(client, unharmed):
    """The worker's output buffers never count against the run's memory limit."""
    code = "import sys\nchunk = 'x' * 65535 + '\\n'\nfor _ in range(240):\n    sys.stdout.write(chunk)"
    res = run(client, code, memory_mb=32, output_limit_bytes=16 * 1024 * 1024)
    assert res["status"] == "ok" and res["attempts"] == 1 and len(res["stdout"]) == 240 * 65536, \
        {k: v for k, v in res.items() if k != "stdout"}
