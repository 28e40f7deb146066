"""Issue decisions per second of the scheduler with many domains and a large registry, and its memory.

    python benchmarks/scheduler_throughput.py [--domains 100] [--tasks 100000] [--groups 20000] [--batch 64]

Builds a registry of ``--tasks`` training tasks over ``--domains`` domains (weights 1-4, a third with
two difficulty levels, a tenth with a sample budget), then issues ``--groups`` training groups in
sampler passes of ``--batch`` (one SQLite transaction each; the groups are marked complete between passes,
untimed, as in a run where at most (η + 1)·B are in flight), with the mix in strict order (``fifo``)
and in cost order (learned seconds per group). Printed beside them, measured in the same run: the
pre-domain issue path (every task of the fewest-groups set read, shuffled, the first ``--batch``
issued) on the same registry. Memory: the process's peak RSS and the planner's allocations
(tracemalloc) per pass. Target: ≥ 2,000 groups/s with 100 domains and 100,000 tasks.
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
import tracemalloc
from pathlib import Path

from scheduler_service.config import DomainConfig, SchedulerSettings
from scheduler_service.issuing import IssuePlanner
from scheduler_service.registry import Registry
from shared.schemas import Task


def build(path: Path, domains: int, tasks: int) -> tuple[Registry, float]:
    """A registry with ``tasks`` tasks over ``domains`` domains; returns it and the seconds it took."""
    t0 = time.perf_counter()
    reg = Registry(path)
    rng = random.Random(0)
    names = [f"domain{i:03d}" for i in range(domains)]
    for i, d in enumerate(names):
        levels = [{"difficulty": [0, 0]}, {"difficulty": [1, 1]}] if i % 3 == 0 else None
        budget = {"samples": 10 ** 9} if i % 10 == 0 else {}
        reg.put_domain(d, DomainConfig(weight=1 + i % 4, levels=levels, budget=budget))
    per = tasks // domains
    for d in names:
        batch = [Task(task_id=f"{d}-{j}", domain=d, prompt=[{"role": "user", "content": f"{d} question {j}"}],
                      verifier={"kind": "exact", "answer": str(rng.randrange(100))}, samples_per_task=8,
                      difficulty=float(j % 2)) for j in range(per)]
        reg.register(batch)
    return reg, time.perf_counter() - t0


def run_planner(reg: Registry, order: str, groups: int, batch: int) -> tuple[float, float]:
    """Issue ``groups`` groups through :class:`IssuePlanner`; returns (groups/s, peak KiB allocated per pass)."""
    planner = IssuePlanner(SchedulerSettings(scheduler={"issue_order": order}), reg)
    if order == "cost":  # pretend every domain's groups were measured: costs from 0.1 to 10 s
        planner._views = {d: type(v)(v.spent, v.in_flight_samples, 0.1 + (hash(d) % 100) / 10)
                          for d, v in planner.views(fresh=True).items()} or {}
        planner._views_at = time.monotonic() + 3600
    tracemalloc.start()
    peak = 0
    done = 0
    dt = 0.0
    while done < groups:
        t0 = time.perf_counter()
        tracemalloc.reset_peak()
        picks = planner.plan(batch)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        done += len(reg.issue_train_groups(picks, deadline_s=600))
        dt += time.perf_counter() - t0
        _settle(reg)
    tracemalloc.stop()
    return done / dt, peak / 1024


def _settle(reg: Registry) -> None:
    """Mark the issued groups complete (untimed): in a run the in-flight groups stay under (η + 1)·B."""
    with reg._tx() as db:
        db.execute("UPDATE \"groups\" SET state = 'complete' WHERE state = 'issued'")


def run_baseline(reg: Registry, groups: int, batch: int) -> float:
    """The pre-domain path: fewest-groups set read in full and shuffled per pass; groups/s."""
    rng = random.Random(0)
    done = 0
    dt = 0.0
    while done < groups:
        t0 = time.perf_counter()
        ids = reg.least_issued_train_tasks()
        rng.shuffle(ids)
        done += len(reg.issue_train_groups(ids[:batch], deadline_s=600))
        dt += time.perf_counter() - t0
        _settle(reg)
    return done / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domains", type=int, default=100)
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--groups", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reg, build_s = build(Path(tmp) / "registry.db", a.domains, a.tasks)
        print(f"registry: {a.domains} domains, {reg.task_counts()['train']} tasks, built in {build_s:.1f} s")
        base = run_baseline(reg, max(a.groups // 10, a.batch), a.batch)
        fifo, fifo_kib = run_planner(reg, "fifo", a.groups, a.batch)
        cost, cost_kib = run_planner(reg, "cost", a.groups, a.batch)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        size_mib = (Path(tmp) / "registry.db").stat().st_size / 2**20
        reg.close()
    print(f"baseline (pre-domain fewest-groups scan): {base:8.0f} groups/s")
    print(f"mix, fifo order:                          {fifo:8.0f} groups/s  ({fifo / base:.1f}x baseline), "
          f"planner peak {fifo_kib:.0f} KiB per pass of {a.batch}")
    print(f"mix, cost order:                          {cost:8.0f} groups/s  ({cost / base:.1f}x baseline), "
          f"planner peak {cost_kib:.0f} KiB per pass of {a.batch}")
    print(f"peak RSS {rss_mib:.0f} MiB; registry file {size_mib:.0f} MiB; target >= 2000 groups/s: "
          f"{'met' if min(fifo, cost) >= 2000 else 'NOT met'}")


if __name__ == "__main__":
    main()
