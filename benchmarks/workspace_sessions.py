"""Workspace sessions of the sandbox: start, first execution, snapshot and rollback with a 50 MB workspace.

    python benchmarks/workspace_sessions.py [--reps 20] [--files 500] [--file-kb 100] [--workers 2]

Starts ``python -m sandbox_service`` (full isolation, ``--workers`` slots) and talks to it over HTTP with one
keep-alive client, the way a rollout does. The workspace: ``--files`` files of ``--file-kb`` KiB of random bytes
plus 200 small source-like files in nested directories, sent once as a plain tar (``PUT /v1/workspaces``).
Then, ``--reps`` times each (median and p95, ms): ``POST /v1/sessions`` (target <= 50 ms), the first execution
in a new session, a snapshot, and a rollback right after ``rm -rf /work/*`` (target <= 50 ms; each rollback is
checked to bring every file back). Baselines from the same run beside each figure: ``GET /healthz`` (the HTTP
floor), a plain ``POST /v1/execute`` of the same program, and copying the workspace with ``shutil.copytree``
on a tmpfs (what a session would cost without overlay layers). Prints the CPU, a table and one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from flywheel.broker import free_port, wait_for_port  # noqa: E402
from shared.precision import cpu_features, cpu_model  # noqa: E402

COUNT = "import os\nprint(sum(len(fs) for _, _, fs in os.walk('.')))"


def workspace(files: int, kb: int) -> tuple[bytes, int, int]:
    """A plain tar of ``files`` random files of ``kb`` KiB and 200 small ones; (body, files, bytes)."""
    buf, n, size = io.BytesIO(), 0, 0
    with tarfile.open(fileobj=buf, mode="w") as t:
        entries = [(f"data/part{i // 100}/blob{i:04d}.bin", os.urandom(kb * 1024)) for i in range(files)]
        entries += [(f"src/pkg{i // 20}/mod{i:03d}.py", f"def f{i}():\n    return {i}\n".encode() * 20)
                    for i in range(200)]
        for name, content in entries:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(content))
            n, size = n + 1, size + len(content)
    return buf.getvalue(), n, size


def ms(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median": round(statistics.median(s) * 1e3, 2), "p95": round(s[min(len(s) - 1, int(0.95 * len(s)))] * 1e3, 2)}


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def start_service(tmp: Path, workers: int) -> tuple[subprocess.Popen, str, dict]:
    port = free_port()
    env = {**os.environ, "FLYWHEEL_SANDBOX__PORT": str(port), "FLYWHEEL_SANDBOX__MAX_CONCURRENCY": str(workers),
           "FLYWHEEL_RUN__DIR": str(tmp), "FLYWHEEL_SANDBOX__HEALTH_CHECK_INTERVAL_S": "0"}
    for k in ("FLYWHEEL_CONFIG", "FLYWHEEL_AUTH__TOKEN", "FLYWHEEL_AUTH__TOKEN_FILE"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_service"], env=env, stdout=open(tmp / "log.txt", "w"),
                            stderr=subprocess.STDOUT, cwd=ROOT)
    wait_for_port("127.0.0.1", port, timeout_s=60)
    token = (tmp / "auth_token").read_text().strip()
    return proc, f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}


def measure(c: httpx.Client, body: bytes, n_files: int, reps: int) -> dict:
    """Every figure (lists of seconds, one per repetition) against the service behind ``c``."""
    digest = hashlib.sha256(body).hexdigest()
    put_s, r = timed(lambda: c.put(f"/v1/workspaces/{digest}", content=body))
    assert r.status_code == 200, r.text
    out: dict[str, list[float]] = {k: [] for k in ("healthz", "start", "first_exec", "plain_exec", "snapshot",
                                                   "rollback", "rm_rf_exec")}
    for _ in range(3):  # warm both paths
        c.post("/v1/execute", json={"code": "print(1)"})
    for _ in range(reps):
        out["healthz"].append(timed(lambda: c.get("/healthz"))[0])
        t, r = timed(lambda: c.post("/v1/sessions", json={"workspace": digest}))
        assert r.status_code == 201, r.text
        out["start"].append(t)
        sid = r.json()["session_id"]
        t, r = timed(lambda: c.post(f"/v1/sessions/{sid}/execute", json={"code": "print(1)"}))
        assert r.json()["status"] == "ok", r.text
        out["first_exec"].append(t)
        t, r = timed(lambda: c.post("/v1/execute", json={"code": "print(1)"}))
        assert r.json()["status"] == "ok", r.text
        out["plain_exec"].append(t)
        c.post(f"/v1/sessions/{sid}/execute", json={"code": "open('notes.txt', 'w').write('x' * 4096)"})
        t, r = timed(lambda: c.post(f"/v1/sessions/{sid}/snapshots"))
        assert r.status_code == 201, r.text
        out["snapshot"].append(t)
        t, r = timed(lambda: c.post(f"/v1/sessions/{sid}/execute", json={"code": "rm -rf /work/*; ls -A | wc -l",
                                                                         "language": "bash", "timeout_s": 30}))
        assert r.json()["stdout"] == "0\n", r.text
        out["rm_rf_exec"].append(t)
        t, r = timed(lambda: c.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 1}))
        assert r.status_code == 200, r.text
        out["rollback"].append(t)
        back = c.post(f"/v1/sessions/{sid}/execute", json={"code": COUNT}).json()
        assert back["stdout"] == f"{n_files + 1}\n", back  # every file back, and the snapshot's own
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204
    return {"put_s": put_s, "service_ms": service_means(c.get("/metrics").text), **out}


def service_means(metrics: str) -> dict[str, float]:
    """Mean milliseconds of the service's own part of each session operation (``…_session_op_seconds``)."""
    sums: dict[str, dict[str, float]] = {}
    for line in metrics.splitlines():
        if line.startswith("flywheel_sandbox_session_op_seconds_") and 'op="' in line:
            kind = line.split("{")[0].rsplit("_", 1)[1]
            op = line.split('op="')[1].split('"')[0]
            sums.setdefault(op, {})[kind] = float(line.rsplit(" ", 1)[1])
    return {op: round(v["sum"] / v["count"] * 1e3, 3) for op, v in sums.items() if v.get("count")}


def copy_baseline(body: bytes, reps: int) -> list[float]:
    """Seconds to copy the unpacked workspace with ``shutil.copytree`` on a tmpfs (/dev/shm when present)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        src = Path(d) / "src"
        with tarfile.open(fileobj=io.BytesIO(body)) as t:
            t.extractall(src, filter="data")
        times = []
        for i in range(reps):
            times.append(timed(lambda: shutil.copytree(src, Path(d) / f"copy{i}"))[0])
            shutil.rmtree(Path(d) / f"copy{i}")
        return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--files", type=int, default=500)
    ap.add_argument("--file-kb", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    print(f"CPU: {cpu_model()} ({cpu_features()}), {os.cpu_count()} cores")
    body, n_files, size = workspace(a.files, a.file_kb)
    print(f"workspace: {n_files} files, {size / 1e6:.1f} MB unpacked, tar {len(body) / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        proc, base, auth = start_service(Path(tmp), a.workers)
        try:
            with httpx.Client(base_url=base, headers=auth, timeout=120) as c:
                got = measure(c, body, n_files, a.reps)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    copies = copy_baseline(body, max(3, a.reps // 4))
    rows = [("PUT workspace (upload + check + unpack, once)", {"median": round(got["put_s"] * 1e3, 1), "p95": "-"}),
            ("GET /healthz (baseline: HTTP floor)", ms(got["healthz"])),
            ("POST /v1/sessions (start)", ms(got["start"])),
            ("copytree of the workspace on tmpfs (baseline)", ms(copies)),
            ("first execution in a new session (print(1))", ms(got["first_exec"])),
            ("POST /v1/execute, same program (baseline)", ms(got["plain_exec"])),
            ("snapshot (after writing one file)", ms(got["snapshot"])),
            ("execution of rm -rf /work/* (bash)", ms(got["rm_rf_exec"])),
            ("rollback after rm -rf /work/*", ms(got["rollback"]))]
    print(f"service's own time (mean ms, from /metrics): {got['service_ms']}")
    print(f"\n| {'step':<50} | median ms | p95 ms |\n|{'-' * 52}|-----------|--------|")
    for name, v in rows:
        print(f"| {name:<50} | {v['median']:>9} | {v['p95']:>6} |")
    print(json.dumps({"benchmark": "workspace_sessions", "cpu": cpu_model(), "features": cpu_features(),
                      "files": n_files, "bytes": size, "reps": a.reps, "workers": a.workers,
                      "service_mean_ms": got["service_ms"],
                      **{name: v for name, v in rows}}))


if __name__ == "__main__":
    main()
