"""The pipeline without a model: scheduler → rollout → verifier → trainer over the embedded broker.

    python benchmarks/null_pipeline.py [--replicas 1 2 4] [--steps 60] [--batch 64] [--k 8] [--tasks 2048]
                                       [--max-tokens 4] [--tokens-per-s 0] [--kind exact] [--traces off]

Per replica count r (a fresh embedded broker, topics created first, and a fresh run directory each):
the scheduler, r rollout replicas with ``rollout.engine: null`` (no model: random token ids at
``--tokens-per-s`` per sample, 0 = as fast as possible), r verifier replicas and the trainer with
``trainer.null_step: true`` (groups assembled, stale and failed ones dropped, steps counted, versions
announced, offsets committed; no forward, backward or optimizer step) run as separate processes
(``python -m <service>``). ``--tasks`` training tasks of the ``--kind`` verifier (``exact``: scored inline,
the cheapest; ``regex``: the toy domain's, in a thread) are posted over REST, and the run goes to
``--steps`` policy versions of ``--batch`` groups of ``--k`` samples.

Measured: trajectories trained per second end to end, over the steady part of the run (from the trainer's
first step to its last: start-up and the first group's latency left out; ``budget.max_staleness`` 1, so
the scheduler keeps at most 2 × batch groups in flight), and the same over the whole run from the first
POST. Printed for each replica count, with the ratio to the 1-replica figure of the same run.

Checked (the run fails otherwise): every trajectory trained exactly once. The null trainer logs the groups
and sample indices of every step (``<checkpoints>/null_trained.jsonl``); no (group, sample) pair may occur
twice, each trained group has its K distinct samples, each step ``--batch`` groups, ``--steps`` steps, and
every trained group is a training group the scheduler's registry issued (``<run dir>/flywheel-registry.db``)
and holds complete with K rewards.

The machine is shared and has 2 cores: all processes of a run compete for them (the broker included), so
the figures are contended; compare a replica count only with the baseline printed beside it.
Run directories are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.broker import EmbeddedBroker, die_with_parent, free_port, stop_pid  # noqa: E402

LEDGER = "null_trained.jsonl"  # trainer_service.null_step.NULL_LEDGER (the benchmark imports no service)


@dataclass
class PipelineResult:
    """One run of the null pipeline. Times in seconds."""

    replicas: int
    steps: int
    batch: int
    k: int
    wall_s: float = 0.0
    """First POST → the trainer's last step seen in its ledger."""
    steady_s: float = 0.0
    """The trainer's first step → its last (ledger line times)."""
    trained: int = 0
    """Trajectories trained (ledger)."""
    steady_trained: int = 0
    """Trajectories trained after the first step (the steady window's)."""
    problems: list[str] = field(default_factory=list)
    """Exactly-once violations and other failures (empty: the run is good)."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user + system, /proc) per process over the steady window (from the poll that saw the
    trainer's first step to the one that saw its last), the broker's included."""
    steady_polled: int = 0
    """Trajectories trained between those two polls (what ``cpu_s`` is divided by)."""

    @property
    def per_s(self) -> float:
        """Trajectories trained per second over the steady window."""
        return self.steady_trained / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def wall_per_s(self) -> float:
        """Trajectories trained per second from the first POST."""
        return self.trained / self.wall_s if self.wall_s > 0 else 0.0


def _config(run_dir: Path, port: int, steps: int, batch: int, k: int, max_tokens: int, tokens_per_s: float,
            staleness: int) -> Path:
    cfg = {
        "model": {"name": "null-model"},
        "run": {"dir": str(run_dir)},
        "auth": {"required": False},
        "kafka": {"partitions": 8},
        "budget": {"batch_groups": batch, "max_staleness": staleness, "max_steps": steps},
        "scheduler": {"port": port, "max_tokens": max_tokens, "eval_before_training": False, "temperature": 1.0},
        "rollout": {"engine": "null", "null_tokens_per_s": tokens_per_s, "max_batch_requests": 256,
                    "max_batch_samples": 2048},
        "verifier": {"max_batch": 1024, "metrics_interval_s": 5.0},
        "trainer": {"null_step": True, "stall_report_s": 600.0},
    }
    path = run_dir / "null.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _spawn(name: str, config: Path, run_dir: Path, bootstrap: str, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update({"FLYWHEEL_CONFIG": str(config), "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
                "FLYWHEEL_RUN__DIR": str(run_dir), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1", **extra_env})
    out = open(run_dir / "logs" / f"{name}.out", "wb")
    try:
        module = f"{name.split('-')[0]}_service"
        prof = [] if os.environ.get("NULL_PIPELINE_PROFILE") != name else ["-m", "cProfile", "-o", str(run_dir / f"{name}.prof")]
        return subprocess.Popen([sys.executable, *prof, "-m", module], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=run_dir,
                                start_new_session=True, preexec_fn=die_with_parent())
    finally:
        out.close()


def _tasks(n: int, k: int, kind: str) -> list[dict]:
    verifier = {"kind": "exact", "answer": "abcd"} if kind == "exact" else {"kind": "regex", "pattern": "^[a-m]"}
    verifier["recipe"] = {"reason": "no truncation gate: the null engine's completions are canned"}  # the scorer alone
    return [{"task_id": f"null-{i}", "domain": "null", "prompt": [{"role": "user", "content": f"say {i}"}],
             "verifier": verifier, "samples_per_task": k, "split": "train"} for i in range(n)]


def _ledger(path: Path) -> list[dict]:
    """The complete lines of the null trainer's ledger (a line it is still writing is left for the next read)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data[:data.rfind(b"\n") + 1].splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def run_pipeline(work: Path, replicas: int, steps: int = 60, batch: int = 64, k: int = 8, tasks: int = 2048,
                 max_tokens: int = 4, tokens_per_s: float = 0.0, kind: str = "exact", traces: str = "off",
                 staleness: int = 1, timeout_s: float = 600.0) -> PipelineResult:
    """Start a null pipeline with ``replicas`` rollout and verifier replicas under ``work``, run it to
    ``steps`` policy versions and check that every trajectory trained exactly once (see the module docstring).
    Every process started is stopped by pid before this returns."""
    res = PipelineResult(replicas, steps, batch, k)
    run_dir = work / f"null-r{replicas}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = _config(run_dir, port, steps, batch, k, max_tokens, tokens_per_s, staleness)
    procs: list[subprocess.Popen] = []
    with EmbeddedBroker.start(log_path=run_dir / "logs" / "broker.log", with_parent=True) as broker:
        import asyncio

        from shared.config import KafkaConfig
        from shared.kafka import ensure_topics

        asyncio.run(ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap_servers, partitions=8), strict=True))
        env = {"FLYWHEEL_TELEMETRY__TRACES": traces}
        try:
            names = ["trainer"] + [f"verifier-{i}" for i in range(replicas)] + [f"rollout-{i}" for i in range(replicas)]
            for name in names + ["scheduler"]:
                procs.append(_spawn(name, config, run_dir, broker.bootstrap_servers, env))
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, procs, 120)
            ledger = run_dir / "checkpoints" / LEDGER
            t0 = time.time()
            body = _tasks(tasks, k, kind)
            for i in range(0, len(body), 512):
                r = httpx.post(f"{url}/v1/tasks", json={"tasks": body[i:i + 512]}, timeout=60)
                if r.status_code != 202:
                    raise RuntimeError(f"POST /v1/tasks: {r.status_code} {r.text[:500]}")
            deadline = time.monotonic() + timeout_s
            lines: list[dict] = []
            cpu0: dict[str, float] = {}
            n0 = 0
            pids = {name: p.pid for name, p in zip(names + ["scheduler"], procs)} | {"broker": broker.pid}
            while time.monotonic() < deadline:
                lines = _ledger(ledger)
                if lines and not cpu0:
                    cpu0 = {name: _cpu_seconds(pid) for name, pid in pids.items()}
                    n0 = sum(sum(len(i) for i in ln["groups"].values()) for ln in lines)
                if len(lines) >= steps:
                    res.cpu_s = {name: _cpu_seconds(pid) - cpu0.get(name, 0.0) for name, pid in pids.items()}
                    res.steady_polled = sum(sum(len(i) for i in ln["groups"].values()) for ln in lines) - n0
                    break
                dead = [p for p in procs if p.poll() is not None]
                if dead:
                    res.problems.append(f"a service exited: pids {[p.pid for p in dead]} (logs in {run_dir}/logs)")
                    break
                time.sleep(0.05)
            t_end = time.time()
            lines = _ledger(ledger)
            res.wall_s = t_end - t0
            _check(res, lines, run_dir, ledger, t0)
        finally:
            for p in procs:
                stop_pid(p, timeout_s=10)
    return res


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/<pid>/stat``); 0.0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a service died during start-up")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the scheduler did not answer /healthz")


def _check(res: PipelineResult, lines: list[dict], run_dir: Path, ledger: Path, t0: float) -> None:
    """Fill ``res``'s counts and times from the ledger and check exactly-once against the registry."""
    if len(lines) < res.steps:
        res.problems.append(f"only {len(lines)} of {res.steps} steps in {res.wall_s:.0f} s")
    seen: dict[tuple[str, int], int] = {}
    groups: dict[str, int] = {}
    for ln in lines:
        if len(ln["groups"]) != res.batch:
            res.problems.append(f"step {ln['step']} trained {len(ln['groups'])} groups, not {res.batch}")
        for gid, idx in ln["groups"].items():
            groups[gid] = groups.get(gid, 0) + 1
            if sorted(idx) != list(range(res.k)):
                res.problems.append(f"group {gid} trained samples {idx}, not 0..{res.k - 1}")
            for i in idx:
                seen[(gid, i)] = seen.get((gid, i), 0) + 1
    twice = [key for key, c in seen.items() if c > 1]
    if twice:
        res.problems.append(f"{len(twice)} trajectories trained more than once, e.g. {twice[:3]}")
    res.trained = len(seen)
    mtime = ledger.stat().st_mtime if ledger.exists() else t0
    res.wall_s = max(1e-9, mtime - t0)
    times = _step_times(run_dir)
    if len(times) >= 2 and len(lines) >= 2:
        res.steady_s = times[min(len(lines), len(times)) - 1] - times[0]
        res.steady_trained = sum(sum(len(i) for i in ln["groups"].values()) for ln in lines[1:len(times)])
    deadline = time.monotonic() + 30  # the scheduler reads flywheel.rewards on its own: let it catch up
    while True:
        with closing(sqlite3.connect(run_dir / "flywheel-registry.db")) as db:
            rows = dict(db.execute("SELECT group_id, received FROM \"groups\" WHERE purpose = 'train'").fetchall())
        missing = [g for g in groups if g not in rows]
        short = [g for g in groups if g in rows and rows[g] < res.k]
        if not (missing or short) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if missing:
        res.problems.append(f"{len(missing)} trained groups unknown to the registry, e.g. {missing[:3]}")
    if short:
        res.problems.append(f"{len(short)} trained groups with fewer than {res.k} rewards in the registry")


def _step_times(run_dir: Path) -> list[float]:
    """Unix times of the trainer's steps, from its log lines ``null step N -> policy version V``."""
    out = []
    log_file = run_dir / "logs" / "trainer.out"
    if not log_file.exists():
        return out
    for line in log_file.read_text(errors="replace").splitlines():
        if "null step " in line:
            out.append(_log_time(line))
    return [t for t in out if t is not None]


def _log_time(line: str) -> float | None:
    import datetime as dt

    try:
        stamp = line[:23]
        return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tokens-per-s", type=float, default=0.0)
    ap.add_argument("--kind", choices=["exact", "regex"], default="exact")
    ap.add_argument("--traces", choices=["off", "local"], default="off")
    ap.add_argument("--staleness", type=int, default=1, help="budget.max_staleness η: (η + 1) x batch groups in flight")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="null-pipeline-"))
    results = []
    try:
        for r in a.replicas:
            res = run_pipeline(work, r, a.steps, a.batch, a.k, a.tasks, a.max_tokens, a.tokens_per_s, a.kind,
                               a.traces, a.staleness)
            results.append(res)
            print(f"replicas {r}: {res.per_s:8.0f} trajectories/s steady ({res.steady_trained} in {res.steady_s:.1f} s), "
                  f"{res.wall_per_s:8.0f}/s from the first POST ({res.trained} in {res.wall_s:.1f} s); "
                  f"exactly once: {'yes' if not res.problems else 'NO: ' + '; '.join(res.problems)}", flush=True)
            per = 1e6 / max(1, res.steady_polled)
            print(f"  CPU per process, steady window of {res.steady_polled} trajectories (s, µs per trajectory): " + ", ".join(
                f"{n} {c:.1f} ({c * per:.0f})" for n, c in res.cpu_s.items()) + f"; total {sum(res.cpu_s.values()):.1f}",
                flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    base = results[0].per_s if results else 0.0
    print(f"\nnull pipeline (batch {a.batch} groups x K={a.k}, η={a.staleness}, {a.max_tokens} tokens, verifier {a.kind}, traces "
          f"{a.traces}, tokens/s {a.tokens_per_s or 'unbounded'}; {os.cpu_count()} cores, shared):")
    for res in results:
        ratio = res.per_s / base if base else 0.0
        print(f"  {res.replicas} rollout + {res.replicas} verifier: {res.per_s:8.0f} trajectories/s "
              f"({ratio:.2f}x the 1-replica run), whole run {res.wall_per_s:.0f}/s, "
              f"{'ok' if not res.problems else 'FAILED'}")
    if results and results[0].replicas == 1:
        print(f"  target >= 5000 trajectories/s with one replica each: {'met' if base >= 5000 else 'NOT met'}")
    return 0 if results and all(not r.problems for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
