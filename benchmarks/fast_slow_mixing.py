"""Fast and slow domains mixed: ``scheduler.issue_order: cost`` against ``fifo``, same settings, one run.

    python benchmarks/fast_slow_mixing.py [--seconds 80] [--warmup-timeout 90] [--sleep 1.5] [--keep DIR]

Two domains of equal weight through the whole system (:class:`flywheel.launcher.LocalSystem`: the
embedded broker and all five services) with a tiny Llama taught (``tests/support/taught.py``) to answer
the prompt ``f`` with a wrong function in a code block:

- ``slow``: tool tasks (``tools: [test_feedback]``, ``max_turns: 2``) whose ``unit_tests`` verifier's test
  sleeps ``--sleep`` seconds before it fails, so the tool loop runs the tests in the sandbox (seconds),
  the model revises once, and the verifier runs the tests again (seconds): a group takes seconds.
- ``fast``: plain tasks with a ``regex`` verifier and 4 new tokens: a group takes milliseconds of work.

Every slow task has the taught prompt and its own test (another argument), every fast task its own
prompt, so none is stored as a duplicate (the registry keys content on prompt and verifier). K = 4
samples per group, B = 4 groups per step, η = 1, ``rollout.max_batch_samples`` 32, 8 sandbox slots
(the tests sleep, they do not compute); the trainer runs with lr 1e-7, so the taught answer survives.

Each order gets its own system, started from the same YAML but for ``scheduler.issue_order``. The
tasks are submitted once the rollout service serves (start-up is not counted in any group's seconds);
warm-up until both domains have completed a group (both costs learned), then a measured window of
``--seconds``. From ``GET /v1/domains`` (deltas over the window): groups completed per minute per domain
and in total (``spend.train.groups``), each domain's share of the groups issued, and the learned
``seconds_per_group`` (issue → last reward, the run's mean) at the end; from the rollout's Metrics
records on flywheel.metrics: the engine's idle fraction over the window (1 − Δ``rollout/busy_s`` /
Δ``rollout/wall_s``) and the last record's running ``rollout/idle_fraction``; from the registry: the mean
length of one domain's runs in the issue order (1 = alternating) and the groups the trainer dropped
(stale). Prints both orders side by side with the ratio cost/fifo (fifo is the baseline measured in the
same invocation) and one JSON line. About 6 minutes on 2 cores; on busy cores the figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from flywheel.launcher import LocalSystem  # noqa: E402

OPT_OUT = {"reason": "no truncation gate: the token budgets here are a few tokens by design, so most completions hit them"}
"""The verifier recipe of these tasks: an explicit opt-out of the verifier's default truncation gate."""
PROMPT = [{"role": "user", "content": "f"}]
"""The one prompt the tiny model is taught (every slow task asks it)."""
WRONG = "```python\ndef f(x):\n    return x\n```"
"""The taught answer: code the ``test_feedback`` loop tests (it fails, so the model revises once)."""
DOMAINS = ("slow", "fast")


def teach(model_dir: Path) -> Path:
    """The tiny Llama taught to answer :data:`PROMPT` with :data:`WRONG`, saved in ``model_dir``."""
    from tests.support.taught import teach_tiny_model

    _, model = teach_tiny_model(model_dir, PROMPT, WRONG)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def system_config(model_dir: Path, run_dir: Path, order: str, samples: int = 4, batch_groups: int = 4,
                  max_batch_samples: int = 32, lookahead: int = 8, sandbox_workers: int = 8) -> dict:
    """The system's YAML as a dict: the two domains (equal weights, nothing retired or flagged), the
    tiny model, lr 1e-7, no evaluation, ``scheduler.issue_order`` = ``order``; ``sandbox_workers``
    sandbox slots (the slow tests sleep rather than compute, so more slots than cores are fine).

    The drift monitor is off: the tiny model answers many ``fast`` prompts with one wrong answer K times
    over, a real ``diversity_collapse`` (0.75 over 8 groups, measured); its breaker then stops the domain,
    and this measures the mix, not the monitor (a CI run failed that way: fast got 4 of 16 issued groups)."""
    keep = {"retire_after": 0, "flag_after": 0}
    return {
        "model": {"name": str(model_dir)},
        "run": {"dir": str(run_dir)},
        "domains": {"slow": {"weight": 1.0, "samples_per_task": samples, "max_tokens": 48, "lifecycle": keep},
                    "fast": {"weight": 1.0, "samples_per_task": samples, "max_tokens": 4, "lifecycle": keep}},
        "budget": {"batch_groups": batch_groups, "max_staleness": 1, "max_steps": 100_000},
        "scheduler": {"max_tokens": 4, "temperature": 1.0, "eval_before_training": False, "issue_order": order,
                      "cost_lookahead": lookahead},
        "rollout": {"engine": "torch", "max_batch_samples": max_batch_samples, "max_trajectory_tokens": 400},
        "sandbox": {"max_concurrency": sandbox_workers},
        "monitor": {"enabled": False},
        "trainer": {"loss": "bnpo", "truncation": "keep", "lr": 1.0e-7, "micro_batch_size": 32,
                    "keep_checkpoints": 1},
    }


def tasks(n: int, sleep_s: float, samples: int = 4) -> list[dict]:
    """``n`` slow and ``n`` fast training tasks (task bodies of ``POST /v1/tasks``), all distinct."""
    out = []
    for i in range(n):
        test = {"name": f"double_{i}", "code": f"import time\ntime.sleep({sleep_s})\nassert f({i + 1}) == {2 * (i + 1)}"}
        out.append({"task_id": f"slow-{i}", "domain": "slow", "prompt": PROMPT, "samples_per_task": samples,
                    "tools": ["test_feedback"], "max_turns": 2,
                    "verifier": {"kind": "unit_tests", "entry_point": "f", "tests": [test], "recipe": OPT_OUT}})
        out.append({"task_id": f"fast-{i}", "domain": "fast", "prompt": [{"role": "user", "content": f"say {i}"}],
                    "samples_per_task": samples, "verifier": {"kind": "regex", "pattern": "^[a-z]", "recipe": OPT_OUT}})
    return out


def submit(url: str, bodies: list[dict], token: str | None = None) -> None:
    """``POST /v1/tasks`` with the system's bearer token (``LocalSystem.token``); raises when any task was
    stored as a duplicate or refused."""
    from shared.auth import auth_headers

    r = httpx.post(f"{url}/v1/tasks", json={"tasks": bodies}, headers=auth_headers(token), timeout=60)
    r.raise_for_status()
    dup = r.json().get("duplicates")
    if dup:
        raise RuntimeError(f"{len(dup)} tasks were stored as duplicates: {dup[:3]}")


def domains(url: str) -> dict[str, dict]:
    """``GET /v1/domains`` by name: ``issued``, ``completed`` (training groups), ``seconds_per_group``."""
    rows = httpx.get(f"{url}/v1/domains", timeout=30).json()
    return {r["domain"]: {"issued": r["groups_issued"], "completed": r["spend"].get("train", {}).get("groups", 0),
                          "seconds_per_group": r["seconds_per_group"]} for r in rows}


async def _rollout_metrics(bootstrap: str, timeout_s: float = 15.0) -> list[dict]:
    """Every rollout Metrics record on flywheel.metrics so far, oldest first (``time`` and ``values``):
    read from the earliest offset until nothing new came for 1 s after the first record (or
    ``timeout_s``)."""
    from shared import kafka, topics
    from shared.config import KafkaConfig
    from shared.schemas import DecodeError, Metrics, decode

    c = kafka.make_consumer(KafkaConfig(bootstrap_servers=bootstrap), topics.METRICS, group_id=None)
    await c.start()
    out, quiet_since, deadline = [], None, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and (quiet_since is None or time.monotonic() - quiet_since < 1.0):
            got = await c.getmany(timeout_ms=300)
            for msgs in got.values():
                for m in msgs:
                    try:
                        rec = decode(m.value, Metrics)
                    except DecodeError:
                        continue
                    if rec.source == "rollout":
                        out.append({"time": rec.time, "values": rec.values})
            if got:
                quiet_since = time.monotonic()
    finally:
        await c.stop()
    return sorted(out, key=lambda r: r["time"])


def rollout_metrics(system: LocalSystem) -> list[dict]:
    """:func:`_rollout_metrics` of ``system``'s broker."""
    return asyncio.run(_rollout_metrics(system.env["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"]))


def wait_for(pred, timeout_s: float, system: LocalSystem, what: str, every_s: float = 1.0):
    """Poll ``pred`` (supervising ``system``) until it returns something truthy; that value.

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        system.check()
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def serving(system: LocalSystem) -> bool:
    """Whether the rollout service has loaded its model and takes requests (its log says so): tasks
    submitted earlier would count the start-up in their groups' seconds."""
    try:
        return "serving rollout pool" in (system.run_dir / "logs" / "rollout.log").read_text(errors="replace")
    except OSError:
        return False


def registry_figures(system: LocalSystem, t0: float) -> dict:
    """From the registry: training groups the trainer dropped (stale, failed, ...) per domain over the
    whole run, and the mean length of the runs of one domain in the issue order since ``t0`` (wall
    time; 1 = strictly alternating, larger = the groups of a domain issued together)."""
    con = sqlite3.connect(f"file:{system.run_dir / 'flywheel-registry.db'}?mode=ro", uri=True, timeout=30)
    try:
        drops = con.execute("SELECT domain, COUNT(*) FROM \"groups\" WHERE purpose = 'train' AND dropped IS NOT NULL"
                            " GROUP BY domain").fetchall()
        order = [r[0] for r in con.execute("SELECT domain FROM \"groups\" WHERE purpose = 'train' AND"
                                           " resample_of IS NULL AND issued_at >= ? ORDER BY rowid", (t0,))]
    finally:
        con.close()
    runs = 1 + sum(1 for x, y in zip(order, order[1:]) if x != y)
    out = {f"{d}_dropped_run": 0 for d in DOMAINS}
    out.update({f"{d}_dropped_run": n for d, n in drops if d in DOMAINS})
    out["mean_issue_run"] = len(order) / runs if order else None
    return out


def window_idle(records: list[dict], t0: float) -> float | None:
    """Engine idle fraction between the last rollout record at or before ``t0`` (else the first) and the
    last record: 1 − Δbusy / Δwall; ``None`` with fewer than two records."""
    if len(records) < 2:
        return None
    before = [r for r in records if r["time"] <= t0]
    a, b = (before[-1] if before else records[0]), records[-1]
    dwall = b["values"]["rollout/wall_s"] - a["values"]["rollout/wall_s"]
    if dwall <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - (b["values"]["rollout/busy_s"] - a["values"]["rollout/busy_s"]) / dwall))


def summarise(start: dict, end: dict, seconds: float, records: list[dict], t0: float, registry: dict) -> dict:
    """The figures of one order from the window's two ``GET /v1/domains`` snapshots, the rollout's
    metrics records and :func:`registry_figures`."""
    res: dict = {"window_s": seconds, **registry}
    issued = {d: end[d]["issued"] - start[d]["issued"] for d in DOMAINS}
    for d in DOMAINS:
        res[f"{d}_groups_per_min"] = (end[d]["completed"] - start[d]["completed"]) * 60.0 / seconds
        res[f"{d}_issued_share"] = issued[d] / max(1, sum(issued.values()))
        res[f"{d}_seconds_per_group"] = end[d]["seconds_per_group"]
    res["total_groups_per_min"] = sum(res[f"{d}_groups_per_min"] for d in DOMAINS)
    res["idle_fraction_window"] = window_idle(records, t0)
    res["idle_fraction_last"] = records[-1]["values"].get("rollout/idle_fraction") if records else None
    res["rollout_records"] = len(records)
    return res


def run_order(order: str, model_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    """One system with ``scheduler.issue_order: order``: start, submit once the rollout serves, warm up
    (a completed group of each domain), measure ``args.seconds``, stop."""
    run_dir = work / order
    run_dir.mkdir(parents=True)
    cfg = run_dir / "system.yaml"
    cfg.write_text(yaml.safe_dump(system_config(model_dir, run_dir / "runs", order, lookahead=args.lookahead,
                                                max_batch_samples=args.max_batch_samples,
                                                sandbox_workers=args.sandbox_workers)))
    t_start = time.monotonic()
    system = LocalSystem.start(cfg, run_dir / "run", timeout_s=240)
    try:
        wait_for(lambda: serving(system), 240, system, "the rollout service to serve")
        print(f"[{order}] system serving after {time.monotonic() - t_start:.0f} s", flush=True)
        url = system.scheduler_url
        submit(url, tasks(args.tasks, args.sleep), system.token)
        wait_for(lambda: all(domains(url).get(d, {}).get("completed", 0) >= 1 for d in DOMAINS),
                 args.warmup_timeout, system, "a completed group of each domain")
        start, t0 = domains(url), time.time()
        print(f"[{order}] warm after {time.monotonic() - t_start:.0f} s; measuring {args.seconds:.0f} s", flush=True)
        end_at = time.monotonic() + args.seconds
        while time.monotonic() < end_at:
            system.check()
            time.sleep(min(1.0, max(0.0, end_at - time.monotonic())))
        end, elapsed = domains(url), time.time() - t0
        records, reg = rollout_metrics(system), registry_figures(system, t0)
    finally:
        system.stop()
    return summarise(start, end, elapsed, records, t0, reg)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def table(results: dict[str, dict]) -> str:
    """Both orders side by side with the ratio cost/fifo."""
    keys = ["total_groups_per_min", "slow_groups_per_min", "fast_groups_per_min", "slow_issued_share",
            "fast_issued_share", "slow_seconds_per_group", "fast_seconds_per_group", "idle_fraction_window",
            "idle_fraction_last", "mean_issue_run", "slow_dropped_run", "fast_dropped_run", "rollout_records",
            "window_s"]
    lines = [f"{'metric':<26}{'cost':>10}{'fifo':>10}{'cost/fifo':>11}"]
    for k in keys:
        c, f = results["cost"].get(k), results["fifo"].get(k)
        ratio = c / f if isinstance(c, (int, float)) and isinstance(f, (int, float)) and f else None
        lines.append(f"{k:<26}{_fmt(c):>10}{_fmt(f):>10}{_fmt(ratio):>11}")
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, teach the model once, run ``cost`` then ``fifo``, print the table and a JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=80.0, help="measured window per order (s)")
    ap.add_argument("--warmup-timeout", type=float, default=90.0, help="bound on the warm-up per order (s)")
    ap.add_argument("--sleep", type=float, default=1.5, help="seconds the slow tasks' test sleeps")
    ap.add_argument("--tasks", type=int, default=64, help="tasks per domain")
    ap.add_argument("--lookahead", type=int, default=8, help="scheduler.cost_lookahead")
    ap.add_argument("--max-batch-samples", type=int, default=32, help="rollout.max_batch_samples")
    ap.add_argument("--sandbox-workers", type=int, default=8, help="sandbox.max_concurrency")
    ap.add_argument("--orders", default="cost,fifo", help="orders to run, in this order")
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs (logs, registries) in this new folder")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fast-slow-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = teach(work / "tiny")
        results = {o: run_order(o, model_dir, work, args) for o in args.orders.split(",")}
    results.setdefault("cost", {})
    results.setdefault("fifo", {})
    print(table(results))
    print(f"total wall {time.monotonic() - t0:.0f} s")
    print(json.dumps({"benchmark": "fast_slow_mixing", **results}, default=float))


if __name__ == "__main__":
    main()
