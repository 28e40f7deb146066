"""Chaos over a toy run: kill -9 services and the broker at random moments; nothing lost, nothing trained twice.

A real ``flywheel run examples/toy.yaml`` (tiny random Llama, the embedded broker, five supervised
services) runs as a subprocess to ``--steps`` policy versions. Meanwhile this harness kills, one at a
time, each target of a seeded, shuffled plan (``--kills-per-service`` of each of the five services,
``--broker-kills`` of the broker) by the pid it reads from ``<run dir>/flywheel.json``, and submits small
batches of training tasks (``POST /v1/tasks`` with the run's token) every ``SUBMIT_INTERVAL_S``, some of
them while the scheduler dies.

When a kill happens: the plan's kill steps are spread evenly over the run (one random step in each of
``len(plan)`` equal slots between ``WARMUP_STEPS`` and ``max_steps - TAIL_STEPS``); a kill waits for its
step, then a random 0–1 s, and a scheduler kill then waits (≤ 3 s) for a POST in flight so it lands
mid-request. The next kill waits until the previous one has recovered: the target runs again under a
new pid and the run has made two more steps.

What is measured, and how:

- **Kill → next step** (seconds): from the SIGKILL to the first time ``GET /v1/status`` (polled every
  ``POLL_S``) reports a policy version above the newest version that existed at the kill (the larger
  of the scheduler's last answer and the newest version directory in the checkpoint store, so a step
  already made but not yet seen never counts as recovery). The scheduler's view is the strict one: the
  step must have gone trainer → broker → scheduler. "2nd step" is the same for the version after: a
  service whose loss the pipeline absorbs for a moment (the trainer may hold a step's groups already)
  shows a short next step and a longer 2nd. "Restarted" is kill → a new pid for the target in
  flywheel.json (the supervisor's part alone). The bounds are on the median kill → next step:
  ≤ 15 s over the service kills, ≤ 30 s over the broker kills.
- **Acknowledged tasks lost**: every task id of every batch that got 202 (ours, and the CLI's own toy
  tasks, since ``flywheel run`` stops on any refusal) must be a row of the registry
  (``<run dir>/flywheel-registry.db``, SQLite, read after the run) with the prompt we sent. A batch
  whose POST failed (connection refused or reset while the scheduler was down) was not acknowledged;
  it must be stored whole or not at all ("partial batches").
- **Samples trained twice**: the trainer trains whole groups, each sample index of a group once
  (``trainer_service.groups.Group.samples`` is keyed by it; a redelivered record of a group already
  trained or held is skipped), so a sample — (group id, sample index) — is trained twice exactly when
  its group is trained in two optimizer steps. Every version directory of the checkpoint store keeps
  ``trained_groups.json``, the ids of the groups of the step that made it; a step lost in a crash
  before its weights were written leaves no directory (the restarted trainer redoes that version from
  the previous one), so the directories of versions 1..max_steps are the run's training history. The
  harness keeps them all (``trainer.keep_checkpoints = max_steps + 1``) and counts ids that occur in
  more than one, weighting each repeat by the group's size from the registry; it also checks each step
  trained ``budget.batch_groups`` groups and every version is there. The redelivered samples the
  trainer skipped are summed from ``train/duplicates_skipped_total`` of the report's history (the
  counter restarts with the trainer: the sum of each run of it).

    python benchmarks/chaos.py --steps 300 --kills-per-service 3 --broker-kills 2 [--seed 0] [--keep]

Prints the table (kills per target, recovery median and max, steps, wall time) and exits 1 if the run
did not reach ``--steps``, anything was lost or trained twice, a kill did not recover, or a median is
over its bound. ``tests/e2e/test_chaos.py`` drives :func:`run_chaos` (a short run in the default
suite, this benchmark's run marked slow). The work directory (model, run dir, logs) is deleted unless
``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.launcher import SERVICES  # noqa: E402
from shared.auth import auth_headers, token_from_run_dir  # noqa: E402
from shared.model import build_tiny_model  # noqa: E402

OPT_OUT = {"reason": "no truncation gate: the token budgets here are a few tokens by design, so most completions hit them"}
"""The verifier recipe of these tasks: an explicit opt-out of the verifier's default truncation gate."""
BROKER = "broker"
TARGETS = (*SERVICES, BROKER)
CONFIG = ROOT / "examples" / "toy.yaml"
"""The run: the toy domain of the end-to-end test (64 training and 16 held-out tasks, 4 groups of 8 per step)."""
BATCH_GROUPS = 4
"""``budget.batch_groups`` of :data:`CONFIG`: groups per optimizer step."""
SERVICE_BOUND_S = 15.0
"""Bound: median kill → next step for a service (seconds)."""
BROKER_BOUND_S = 30.0
"""Bound: median kill → next step for the broker (seconds)."""
POLL_S = 0.2
"""Period of the harness's ``GET /v1/status`` (seconds): the resolution of every recovery time."""
WARMUP_STEPS = 5
"""No kill before this policy version (the first steps include start-up and the first eval)."""
TAIL_STEPS = 5
"""No kill planned in the last this many steps (a kill must be able to show two more steps)."""
SUBMIT_INTERVAL_S = 2.0
"""Seconds between two task batches."""
SUBMIT_BATCH = 2
"""Tasks per submitted batch."""


@dataclass
class Kill:
    """One kill -9 and what followed. Times in seconds."""

    target: str
    """A service name or ``broker``."""
    pid: int
    at_version: int
    """The newest policy version that existed at the kill."""
    at_s: float
    """Since the CLI was started."""
    mid_post: bool = False
    """A POST /v1/tasks was in flight at the kill (scheduler kills try for one)."""
    next_step_s: float | None = None
    """Kill → the scheduler reports a version above :attr:`at_version`; None if never seen."""
    second_step_s: float | None = None
    """Kill → a version above :attr:`at_version` + 1."""
    new_pid: int | None = None
    """The target's next pid in flywheel.json; None if it never changed."""
    restart_s: float | None = None
    """Kill → the new pid is in flywheel.json (the supervisor restarted it)."""


@dataclass
class ChaosResult:
    """Everything one chaos run showed (see the module docstring for how each figure is obtained)."""

    max_steps: int
    returncode: int | None
    """``flywheel run``'s exit status (None: it did not finish in time and was stopped)."""
    steps: int
    """Steps in the CLI's report (0 without a report)."""
    wall_s: float
    planned: list[str]
    kills: list[Kill] = field(default_factory=list)
    acked_tasks: int = 0
    """Task ids acknowledged with 202: ours plus the CLI's own."""
    acked_batches: int = 0
    unacked_batches: int = 0
    """Our batches whose POST failed or was refused."""
    lost_tasks: list[str] = field(default_factory=list)
    """Acknowledged ids missing from the registry or stored with another prompt."""
    partial_batches: int = 0
    """Unacknowledged batches stored in part."""
    acked_train: int = 0
    acked_train_issued: int = 0
    """Acknowledged training tasks the scheduler issued at least once (for information: one acknowledged near
    the end may not have had its turn)."""
    trained_groups: int = 0
    """Group trainings over versions 1..max_steps (repeats included)."""
    distinct_groups: int = 0
    groups_trained_twice: int = 0
    samples_trained_twice: int = 0
    missing_versions: list[int] = field(default_factory=list)
    """Versions without ``trained_groups.json`` (the check cannot vouch for them)."""
    bad_steps: list[int] = field(default_factory=list)
    """Versions whose step did not train ``budget.batch_groups`` groups."""
    duplicates_skipped: int = 0
    cli_tail: str = ""
    """The end of the CLI's output (for failures)."""

    def medians(self) -> dict[str, float | None]:
        """Median kill → next step over the service kills and over the broker kills (None: no such kill)."""
        out = {}
        for kind, pick in (("services", lambda k: k.target != BROKER), ("broker", lambda k: k.target == BROKER)):
            xs = [k.next_step_s if k.next_step_s is not None else float("inf") for k in self.kills if pick(k)]
            out[kind] = statistics.median(xs) if xs else None
        return out

    @property
    def ok(self) -> bool:
        """The issue's criteria: the run finished, every planned kill happened and recovered, nothing lost or
        trained twice, both medians within their bounds."""
        med = self.medians()
        return (self.returncode == 0 and self.steps == self.max_steps and len(self.kills) == len(self.planned)
                and all(k.next_step_s is not None for k in self.kills) and not self.lost_tasks
                and self.partial_batches == 0 and self.samples_trained_twice == 0 and not self.missing_versions
                and not self.bad_steps and self.trained_groups == self.max_steps * BATCH_GROUPS
                and (med["services"] is None or med["services"] <= SERVICE_BOUND_S)
                and (med["broker"] is None or med["broker"] <= BROKER_BOUND_S))


def kill_plan(kills_per_service: int, broker_kills: int, seed: int) -> list[str]:
    """``kills_per_service`` of each service and ``broker_kills`` of the broker, shuffled with ``seed``."""
    plan = [s for s in SERVICES for _ in range(kills_per_service)] + [BROKER] * broker_kills
    random.Random(seed).shuffle(plan)
    return plan


def kill_steps(n: int, max_steps: int, rng: random.Random) -> list[int]:
    """One random step in each of ``n`` equal slots of [:data:`WARMUP_STEPS`, ``max_steps`` − :data:`TAIL_STEPS`).

    Raises:
        ValueError: the run is too short for ``n`` kills (fewer than 2 steps per slot).
    """
    lo, hi = WARMUP_STEPS, max_steps - TAIL_STEPS
    if n and (hi - lo) < 2 * n:
        raise ValueError(f"{max_steps} steps leave too little room for {n} kills")
    width = (hi - lo) / max(n, 1)
    return [rng.randrange(int(lo + i * width), max(int(lo + (i + 1) * width), int(lo + i * width) + 1))
            for i in range(n)]


# ---------------------------------------------------------------------------- watchers


class StepWatch(threading.Thread):
    """Polls ``GET /v1/status`` every :data:`POLL_S` and keeps each change of the policy version with its
    time (``time.monotonic()``); a scheduler that does not answer is simply not heard from."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="chaos-steps")
        self.url, self.stop = url, threading.Event()
        self.version = 0
        self.changes: list[tuple[float, int]] = []

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.wait(POLL_S):
                try:
                    v = int(client.get(f"{self.url}/v1/status").json()["policy_version"])
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                if v > self.version:
                    self.version = v
                    self.changes.append((time.monotonic(), v))

    def first_above(self, version: int, since: float) -> float | None:
        """When (monotonic) a version above ``version`` was first seen at or after ``since``; None if not yet."""
        return next((t for t, v in self.changes if v > version and t >= since), None)


def task_batch(k: int, rng: random.Random) -> list[dict]:
    """Batch ``k``: :data:`SUBMIT_BATCH` toy training tasks (ids ``chaos-<k>-<i>``, distinct prompts)."""
    return [{"task_id": f"chaos-{k}-{i}", "domain": "toy_prefix", "split": "train", "samples_per_task": 8,
             "prompt": [{"role": "user", "content": f"{rng.randrange(10_000):04d}c{k}x{i}"}],
             "verifier": {"kind": "regex", "pattern": "^[a-z]", "recipe": OPT_OUT}} for i in range(SUBMIT_BATCH)]


class Submitter(threading.Thread):
    """Posts a batch of :data:`SUBMIT_BATCH` toy training tasks every :data:`SUBMIT_INTERVAL_S` with the run's
    token; keeps each batch and whether it was acknowledged (202). :attr:`posting` is set while a POST is
    in flight."""

    def __init__(self, url: str, run_dir: Path, seed: int) -> None:
        super().__init__(daemon=True, name="chaos-submit")
        self.url, self.run_dir, self.rng = url, run_dir, random.Random(seed)
        self.stop, self.posting = threading.Event(), threading.Event()
        self.batches: list[tuple[list[dict], bool]] = []

    def run(self) -> None:
        k = 0
        with httpx.Client(timeout=10.0) as client:
            while not self.stop.wait(SUBMIT_INTERVAL_S):
                batch, ok = task_batch(k, self.rng), False
                k += 1
                self.posting.set()
                try:
                    r = client.post(f"{self.url}/v1/tasks", json={"tasks": batch},
                                    headers=auth_headers(token_from_run_dir(self.run_dir)))
                    ok = r.status_code == 202
                except httpx.HTTPError:
                    pass
                finally:
                    self.posting.clear()
                self.batches.append((batch, ok))


# ---------------------------------------------------------------------------- the run


def _state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "flywheel.json").read_text())
    except (OSError, ValueError):
        return None


def _pid(state: dict | None, target: str) -> int | None:
    if state is None:
        return None
    return state.get("broker_pid") if target == BROKER else state.get("services", {}).get(target)


def _running(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie its supervisor has yet to reap)."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def _newest_checkpoint(run_dir: Path) -> int:
    """The newest version directory of the checkpoint store (0: none)."""
    vs = [int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v*")
          if p.is_dir() and p.name[1:].isdigit()]
    return max(vs, default=0)


@dataclass
class _Run:
    """What one kill needs to know about the run in progress."""

    proc: subprocess.Popen
    run_dir: Path
    watch: StepWatch
    submitter: Submitter
    t0: float
    max_steps: int
    rng: random.Random

    def version(self) -> int:
        return max(self.watch.version, _newest_checkpoint(self.run_dir))

    def wait(self, until, timeout_s: float) -> bool:
        """Poll ``until()`` every 0.1 s; False when the CLI exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while not until():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def _kill_once(run: _Run, target: str, step: int, recovery_timeout_s: float) -> Kill | None:
    """Wait for ``step`` (and a random 0–1 s; a scheduler kill also for a POST in flight), kill -9 ``target``,
    then wait for its recovery: a new pid and two more steps. None when the run ended or neared its end
    before the kill."""
    last = run.max_steps - 2
    if not run.wait(lambda: run.version() >= min(step, last), recovery_timeout_s) or run.version() >= last:
        return None
    time.sleep(run.rng.uniform(0.0, 1.0))
    if not run.wait(lambda: _running(_pid(_state(run.run_dir), target)), 30.0):
        return None
    pid = _pid(_state(run.run_dir), target)
    if target == "scheduler":
        run.submitter.posting.wait(3.0)
    at_version, mid_post = run.version(), run.submitter.posting.is_set()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it died on its own a moment ago: not our kill
        return None
    t_kill = time.monotonic()
    kill = Kill(target, pid, at_version, t_kill - run.t0, mid_post)

    def recovered() -> bool:
        if kill.new_pid is None and _pid(_state(run.run_dir), target) not in (None, pid):
            kill.new_pid, kill.restart_s = _pid(_state(run.run_dir), target), time.monotonic() - t_kill
        return kill.new_pid is not None and run.watch.first_above(at_version + 1, t_kill) is not None

    run.wait(recovered, recovery_timeout_s)
    first, second = run.watch.first_above(at_version, t_kill), run.watch.first_above(at_version + 1, t_kill)
    kill.next_step_s = None if first is None else first - t_kill
    kill.second_step_s = None if second is None else second - t_kill
    print(f"  kill {target:9s} pid {pid:7d} at v{at_version:<4d} {'(mid-POST) ' if mid_post else ''}-> restarted "
          f"{_s(kill.restart_s)} (pid {kill.new_pid}), next step {_s(kill.next_step_s)}, 2nd {_s(kill.second_step_s)}",
          flush=True)
    return kill


def _start_cli(model_dir: Path, work: Path, max_steps: int, timeout_s: float) -> tuple[subprocess.Popen, Path]:
    run_dir, report = work / "run", work / "report.json"
    cmd = [sys.executable, "-m", "flywheel.cli", "run", str(CONFIG), "--set", f"model.name={model_dir}",
           "--set", f"budget.max_steps={max_steps}", "--set", f"trainer.keep_checkpoints={min(max_steps + 1, 1000)}",
           "--run-dir", str(run_dir), "--report", str(report), "--timeout", str(timeout_s)]
    out = open(work / "cli.out", "wb")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    out.close()
    return proc, run_dir


def run_chaos(model_dir: Path, work: Path, max_steps: int, plan: list[str], seed: int = 0,
              timeout_s: float = 1800.0, recovery_timeout_s: float = 180.0) -> ChaosResult:
    """One chaos run (module docstring) in ``work`` (created; the caller deletes it); returns what it showed.

    Args:
        model_dir: a model directory (``shared.model.build_tiny_model``).
        max_steps: ``budget.max_steps`` of the run.
        plan: the targets to kill, in order (:func:`kill_plan`); names from :data:`TARGETS`.
        timeout_s: ``flywheel run --timeout``; the harness stops the CLI 120 s after it.
        recovery_timeout_s: how long a kill may take to recover before the harness stops killing.

    Raises:
        ValueError: an unknown target, or too many kills for ``max_steps`` (:func:`kill_steps`).
    """
    if unknown := set(plan) - set(TARGETS):
        raise ValueError(f"unknown kill targets {sorted(unknown)}: expected {TARGETS}")
    rng = random.Random(seed)
    steps_at = kill_steps(len(plan), max_steps, rng)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc, run_dir = _start_cli(model_dir, work, max_steps, timeout_s)
    result = ChaosResult(max_steps, None, 0, 0.0, list(plan))
    watch = submitter = None
    try:
        if not _wait_up(proc, run_dir, 300.0):
            return _finish(result, proc, work, run_dir, t0, timeout_s)
        url = _state(run_dir)["scheduler_url"]
        watch, submitter = StepWatch(url), Submitter(url, run_dir, seed)
        watch.start()
        submitter.start()
        run = _Run(proc, run_dir, watch, submitter, t0, max_steps, rng)
        for target, step in zip(plan, steps_at):
            kill = _kill_once(run, target, step, recovery_timeout_s)
            if kill is None:
                break
            result.kills.append(kill)
            if kill.next_step_s is None or kill.second_step_s is None:
                break  # not recovered: no further kill, let the run end as it will
        run.wait(lambda: watch.version >= max_steps, timeout_s)
    finally:
        for t in (submitter, watch):
            if t is not None:
                t.stop.set()
                t.join(15)
    _finish(result, proc, work, run_dir, t0, timeout_s)
    check_tasks(result, run_dir, submitter.batches if submitter else [])
    check_training(result, run_dir, work / "report.json")
    return result


def _wait_up(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> bool:
    """Wait for flywheel.json (the system is up); False if the CLI exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while _state(run_dir) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _finish(result: ChaosResult, proc: subprocess.Popen, work: Path, run_dir: Path, t0: float,
            timeout_s: float) -> ChaosResult:
    """Wait for the CLI (its own ``--timeout`` plus 120 s), stop it and whatever it left, fill the run's
    outcome: exit status, steps from its report, wall time and the end of its output."""
    try:
        proc.wait(max(10.0, timeout_s + 120 - (time.monotonic() - t0)))
        result.returncode = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the CLI stops its services on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    result.wall_s = time.monotonic() - t0
    stop_leftovers(work)
    try:
        result.steps = int(json.loads((work / "report.json").read_text())["steps"])
    except (OSError, ValueError, KeyError):
        result.steps = 0
    try:
        result.cli_tail = (work / "cli.out").read_text(errors="replace")[-6000:]
    except OSError:
        pass
    return result


def stop_leftovers(work: Path) -> list[int]:
    """SIGKILL, by pid, every process whose working directory is ``work`` or below it (the CLI, the broker and
    the services all run there); returns their pids. Never this process."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(d / "cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == str(work) or cwd.startswith(str(work) + "/"):
            found.append(int(d.name))
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


# ---------------------------------------------------------------------------- checks after the run


def _registry(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'flywheel-registry.db'}?mode=ro", uri=True)


def check_tasks(result: ChaosResult, run_dir: Path, batches: list[tuple[list[dict], bool]]) -> None:
    """Acknowledged tasks lost and partial batches (module docstring), from the registry."""
    from flywheel.config import load_config
    from flywheel.tasks import make_tasks

    cli_tasks = make_tasks(load_config(CONFIG).tasks) if result.steps else []  # acknowledged, or the run stopped
    acked = cli_tasks + [t for batch, ok in batches if ok for t in batch]
    result.acked_tasks = len(acked)
    result.acked_batches = sum(ok for _, ok in batches)
    result.unacked_batches = len(batches) - result.acked_batches
    if not (run_dir / "flywheel-registry.db").exists():
        result.lost_tasks = [t["task_id"] for t in acked]
        return
    with closing(_registry(run_dir)) as db:
        rows = db.execute("SELECT task_id, payload, groups_issued FROM tasks").fetchall()
    stored = {tid: json.loads(payload) for tid, payload, _ in rows}
    issued = {tid for tid, _, n in rows if n > 0}
    result.acked_train_issued = sum(t["task_id"] in issued for t in acked if t.get("split", "train") == "train")
    result.acked_train = sum(t.get("split", "train") == "train" for t in acked)
    result.lost_tasks = [t["task_id"] for t in acked
                         if t["task_id"] not in stored or stored[t["task_id"]].get("prompt") != t["prompt"]]
    for batch, ok in batches:
        if not ok and 0 < sum(t["task_id"] in stored for t in batch) < len(batch):
            result.partial_batches += 1


def check_training(result: ChaosResult, run_dir: Path, report: Path) -> None:
    """Groups and samples trained twice, over the version directories 1..max_steps (module docstring)."""
    seen: dict[str, int] = {}
    for v in range(1, result.max_steps + 1):
        p = run_dir / "checkpoints" / f"v{v:06d}" / "trained_groups.json"
        try:
            ids = json.loads(p.read_text())
        except (OSError, ValueError):
            result.missing_versions.append(v)
            continue
        if len(ids) != BATCH_GROUPS:
            result.bad_steps.append(v)
        for gid in ids:
            seen[gid] = seen.get(gid, 0) + 1
    result.trained_groups = sum(seen.values())
    result.distinct_groups = len(seen)
    twice = {g: n for g, n in seen.items() if n > 1}
    result.groups_trained_twice = len(twice)
    sizes: dict[str, int] = {}
    if twice and (run_dir / "flywheel-registry.db").exists():
        with closing(_registry(run_dir)) as db:
            sizes = dict(db.execute(f'SELECT group_id, n FROM "groups" WHERE group_id IN '
                                    f'({",".join("?" * len(twice))})', list(twice)))
    result.samples_trained_twice = sum((n - 1) * sizes.get(g, 8) for g, n in twice.items())
    try:
        history = json.loads(report.read_text())["history"]
    except (OSError, ValueError, KeyError):
        history = []
    total, run_max = 0, 0.0
    for h in sorted(history, key=lambda h: h["step"]):
        x = h.get("train/duplicates_skipped_total") or 0.0
        if x < run_max:  # the trainer restarted: its counter began again
            total, run_max = total + int(run_max), 0.0
        run_max = max(run_max, x)
    result.duplicates_skipped = total + int(run_max)


# ---------------------------------------------------------------------------- the table


def _s(x: float | None) -> str:
    return "never" if x is None or x == float("inf") else f"{x:.1f} s"


def format_table(r: ChaosResult) -> str:
    """The run's table: per target the kills and their recovery (median, max), then the totals and checks."""
    lines = [f"chaos over a toy run: {r.steps}/{r.max_steps} steps, flywheel run exit {r.returncode}, "
             f"{len(r.kills)}/{len(r.planned)} kills, wall {r.wall_s:.0f} s",
             f"{'target':10s} {'kills':>5s} {'restarted: median':>18s} {'next step: median':>18s} {'max':>8s} "
             f"{'2nd step: median':>17s} {'max':>8s}"]

    def row(name: str, ks: list[Kill]) -> str:
        def col(attr: str) -> list[float]:
            return [getattr(k, attr) if getattr(k, attr) is not None else float("inf") for k in ks]

        def med(xs: list[float]) -> str:
            return _s(statistics.median(xs)) if xs else "-"

        def mx(xs: list[float]) -> str:
            return _s(max(xs)) if xs else "-"

        rst, nxt, snd = col("restart_s"), col("next_step_s"), col("second_step_s")
        return (f"{name:10s} {len(ks):5d} {med(rst):>18s} {med(nxt):>18s} {mx(nxt):>8s} {med(snd):>17s} "
                f"{mx(snd):>8s}")

    for t in TARGETS:
        lines.append(row(t, [k for k in r.kills if k.target == t]))
    services = [k for k in r.kills if k.target != BROKER]
    lines.append(row("services", services))
    med = r.medians()
    lines.append(f"median kill -> next step: services {_s(med['services'])} (bound {SERVICE_BOUND_S:.0f} s), "
                 f"broker {_s(med['broker'])} (bound {BROKER_BOUND_S:.0f} s)")
    mid = sum(k.mid_post for k in r.kills if k.target == "scheduler")
    lines.append(f"acknowledged tasks {r.acked_tasks} ({r.acked_batches} of our batches acknowledged, "
                 f"{r.unacked_batches} refused or unanswered; {mid} scheduler kills mid-POST): lost "
                 f"{len(r.lost_tasks)}, partial batches {r.partial_batches}; training tasks issued at least once "
                 f"{r.acked_train_issued}/{r.acked_train}")
    lines.append(f"groups trained {r.trained_groups} ({r.distinct_groups} distinct, {r.max_steps} steps x "
                 f"{BATCH_GROUPS}): trained twice {r.groups_trained_twice} groups, {r.samples_trained_twice} samples; "
                 f"versions missing {len(r.missing_versions)}, steps of another size {len(r.bad_steps)}; "
                 f"redelivered samples skipped {r.duplicates_skipped}")
    lines.append(f"all criteria met: {r.ok}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kills-per-service", type=int, default=3)
    ap.add_argument("--broker-kills", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="flywheel run --timeout (seconds)")
    ap.add_argument("--recovery-timeout", type=float, default=180.0, help="seconds a kill may take to recover")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (model, run dir, CLI output)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flywheel-chaos-"))
    plan = kill_plan(args.kills_per_service, args.broker_kills, args.seed)
    print(f"work dir {work}; plan ({len(plan)} kills): {' '.join(plan)}", flush=True)
    try:
        result = run_chaos(build_tiny_model(work / "tiny"), work / "chaos", args.steps, plan, args.seed,
                           args.timeout, args.recovery_timeout)
        if not result.ok:
            print(result.cli_tail[-3000:])
        print(format_table(result))
    finally:
        stop_leftovers(work)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
