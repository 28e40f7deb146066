"""What the drift monitor costs the scheduler per reward, in CPU and in memory, beside what the scheduler
already spends per reward.

    python benchmarks/monitor_cost.py [--domains 100] [--rewards 100000] [--k 8] [--baseline-rewards 10000]

The scheduler feeds every counted RewardEvent to :meth:`scheduler_service.monitor.DriftMonitor.observe_reward`
right after :meth:`scheduler_service.registry.Registry.record_reward` (its SQLite transaction), both in
its one event loop. So the figure that matters is the monitor's CPU per reward *as a share of the
registry's*, measured in the same run on the same events (absolute times move with the machine's load).

- **Events**: ``--rewards`` training RewardEvents in groups of ``--k``, round-robin over ``--domains``
  domains of 16 tasks each, pre-built (construction is not timed). Per sample: about 40 % one of three
  canonical answers of its task (the first right, reward 1; the others wrong, 0; the same reward each
  time, as a deterministic verifier gives, so the consistency check has repeats to compare), the rest a
  distinct completion passing at the task's own rate (0.3 to 0.7) with partial credit; lengths around
  200 tokens, 3 % truncated at 512, 1 % flagged by a hack detector, 0.5 % infrastructure errors; a
  surprisal per sample.
  The stream is stationary, so breakers stay closed and the monitor does its full work on every event
  (the alerts and breakers it raised are printed: a breaker that opened would skip that domain's work).
- **CPU** (``time.process_time``): the monitor on all ``--rewards`` events, and the registry's
  ``record_reward`` on the first ``--baseline-rewards`` of them (their tasks registered and groups issued
  first, untimed), both as milliseconds per 1,000 rewards, and their ratio. Each ``record_reward`` is a
  durable SQLite commit, so the registry sits in a temporary directory under ``/dev/shm`` when there is one
  (``--registry-dir`` to choose): waiting for a disk's fsync is not CPU time, but at hundreds per second it
  would stretch the run by minutes, and the CPU of a commit to a disk is no less than to tmpfs, so if
  anything the ratio is overstated.
- **Memory** (``tracemalloc``): a fresh monitor fed, domain by domain round-robin, until every domain's
  windows hold ``window + reference`` samples and its consistency map ``consistency_pairs`` distinct
  (task, completion) pairs (distinct completions); its allocations then (current) and at the most
  (peak), in MiB and per domain.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

from scheduler_service.config import MonitorConfig
from scheduler_service.monitor import DriftMonitor
from scheduler_service.registry import Registry
from shared.schemas import RewardEvent, Task

TASKS_PER_DOMAIN = 16


def domain_names(domains: int) -> list[str]:
    """The benchmark's domain names."""
    return [f"domain{i:03d}" for i in range(domains)]


def group_plan(domains: int, groups: int) -> list[tuple[str, str, str]]:
    """``(domain, task_id, group_id)`` of the first ``groups`` groups: round-robin over the domains, then
    over each domain's tasks; group ids as :meth:`Registry.issue_train_groups` writes them in this order."""
    names = domain_names(domains)
    out = []
    for g in range(groups):
        d, h = names[g % domains], g // domains
        task = f"{d}-t{h % TASKS_PER_DOMAIN}"
        out.append((d, task, f"{task}:{h // TASKS_PER_DOMAIN}"))
    return out


def make_events(domains: int, rewards: int, k: int, seed: int = 0, distinct: bool = False) -> list[RewardEvent]:
    """``rewards`` training RewardEvents (rounded up to whole groups of ``k``), as the module docstring
    describes; ``distinct``: every completion distinct and every task passing half the time (to fill the
    consistency maps with no chance of a critical pass-rate move opening a breaker on the way)."""
    rng = random.Random(seed)
    p_task, answers = {}, {}
    for d in domain_names(domains):
        for j in range(TASKS_PER_DOMAIN):
            t = f"{d}-t{j}"
            p_task[t] = 0.5 if distinct else rng.uniform(0.3, 0.7)
            answers[t] = [f"{rng.getrandbits(64):016x}" for _ in range(3)]  # completion_hash: 16 hex digits
    out = []
    for g, (d, task, gid) in enumerate(group_plan(domains, math.ceil(rewards / k))):
        for i in range(k):
            r = rng.random()
            if not distinct and r < 0.4:  # a canonical answer: the first right (1.0), the others wrong (0.0)
                a = 0 if r < 0.2 else 1 + (r >= 0.3)
                chash, passed, reward = answers[task][a], a == 0, float(a == 0)
            else:
                chash = f"{rng.getrandbits(64):016x}"
                passed = rng.random() < p_task[task]
                reward = 1.0 if passed else (0.0, 0.0, 0.25, 0.5)[int(4 * r) % 4]
            r2 = rng.random()
            infra, truncated, hacked = r2 < 0.005, 0.005 <= r2 < 0.035, 0.035 <= r2 < 0.045
            tokens = 512 if truncated else 80 + int(120 * (rng.random() + rng.random() + rng.random()) * r2 ** 0.1)
            out.append(RewardEvent(
                task_id=task, group_id=gid, trajectory_id=f"{gid}/{i}", sample_index=i, group_size=k, domain=d,
                difficulty=0.0, purpose="train", reward=0.0 if infra else reward, passed=passed and not infra,
                infra_error=infra, reason="sandbox unreachable" if infra else None, completion_tokens=tokens,
                finish_reason="length" if truncated else "stop", policy_version=g // (domains * 4),
                cost={"generated_tokens": float(tokens), "verify_seconds": 0.002},
                completion_hash=None if infra else chash, surprisal=0.3 + 1.2 * r2,
                hacks=["multiple_answers"] if hacked else []))
    return out


_NONE: dict = {}


def _no_overrides(domain: str) -> dict:
    """No per-domain thresholds, as one stored dict (the guard passes each domain row's ``config.monitor``,
    the same object until the row changes: the monitor caches thresholds by its identity)."""
    return _NONE


def run_monitor(events: list[RewardEvent]) -> tuple[float, DriftMonitor, list]:
    """CPU seconds of :meth:`DriftMonitor.observe_reward` over ``events`` (level 0, as the guard passes a
    one-level domain's); the monitor and the alerts it raised."""
    mon = DriftMonitor(MonitorConfig(), _no_overrides, clock=lambda: 0.0)
    alerts = []
    t0 = time.process_time()
    for ev in events:
        alerts += mon.observe_reward(ev, 0, ev.policy_version)
    return time.process_time() - t0, mon, alerts


def run_registry(tmp: Path, domains: int, events: list[RewardEvent], k: int) -> float:
    """CPU seconds of :meth:`Registry.record_reward` over ``events``, after registering their tasks and
    issuing their groups (untimed)."""
    reg = Registry(tmp / "registry.db")
    try:
        for d in domain_names(domains):
            reg.register([Task(task_id=f"{d}-t{j}", domain=d, prompt=[{"role": "user", "content": f"{d} question {j}"}],
                               verifier={"kind": "exact", "answer": str(j)}, samples_per_task=k)
                          for j in range(TASKS_PER_DOMAIN)])
        plan = group_plan(domains, math.ceil(len(events) / k))
        issued = []
        for i in range(0, len(plan), 1000):
            issued += [g.group_id for g in reg.issue_train_groups([t for _, t, _ in plan[i:i + 1000]], 3600)]
        assert issued == [gid for _, _, gid in plan], "group ids differ from the plan"
        t0 = time.process_time()
        counted = sum(reg.record_reward(ev).counted for ev in events)
        dt = time.process_time() - t0
        assert counted == len(events), f"only {counted} of {len(events)} rewards counted"
        return dt
    finally:
        reg.close()


def measure_memory(domains: int, k: int) -> tuple[float, float, int]:
    """``(current MiB, peak MiB, not_full)`` of a monitor's allocations once every domain's windows and
    consistency map are full (``not_full``: the domains found otherwise, e.g. after a breaker opened)."""
    cfg = MonitorConfig()
    # a little over the map's size: infrastructure errors carry no completion and leave no pair
    per_domain = math.ceil(max(1.05 * cfg.consistency_pairs + k, cfg.window + cfg.reference) / k) * k
    events = make_events(domains, per_domain * domains, k, seed=1, distinct=True)  # built before tracing
    tracemalloc.start()
    try:
        mon = DriftMonitor(cfg, _no_overrides, clock=lambda: 0.0)
        for ev in events:
            mon.observe_reward(ev, 0, ev.policy_version)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    full = sum(len(w.samples) == cfg.window + cfg.reference and len(w.pairs) == cfg.consistency_pairs
               for w in mon.watches.values())
    return current / 2**20, peak / 2**20, domains - full


def main() -> None:
    """Parse the options, measure, print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domains", type=int, default=100)
    ap.add_argument("--rewards", type=int, default=100_000)
    ap.add_argument("--k", type=int, default=8, help="samples per group")
    ap.add_argument("--baseline-rewards", type=int, default=10_000,
                    help="rewards through the registry (the first ones of the same stream)")
    ap.add_argument("--registry-dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                    help="where the baseline's temporary registry goes (default /dev/shm when present)")
    a = ap.parse_args()
    t_build = time.perf_counter()
    events = make_events(a.domains, a.rewards, a.k)
    base_n = min(len(events), math.ceil(a.baseline_rewards / a.k) * a.k)
    print(f"{len(events)} rewards in groups of {a.k} over {a.domains} domains ({TASKS_PER_DOMAIN} tasks each), "
          f"built in {time.perf_counter() - t_build:.1f} s (untimed)")
    mon_s, mon, alerts = run_monitor(events)
    with tempfile.TemporaryDirectory(prefix="monitor-cost-", dir=a.registry_dir) as tmp:
        reg_s = run_registry(Path(tmp), a.domains, events[:base_n], a.k)
    mon_ms, reg_ms = 1000 * mon_s / len(events) * 1000, 1000 * reg_s / base_n * 1000
    opened = sum(b.trips for b in mon.breakers.values())
    crit = sum(x.severity == "critical" for x in alerts)
    print(f"registry.record_reward (baseline): {reg_ms:8.1f} ms CPU per 1000 rewards  (over {base_n} rewards)")
    print(f"monitor.observe_reward:            {mon_ms:8.1f} ms CPU per 1000 rewards  (over {len(events)} rewards)")
    print(f"monitor / registry:                {mon_ms / reg_ms:8.3f}   (monitor adds {100 * mon_ms / reg_ms:.1f} % "
          f"to the registry's CPU per reward)")
    by_signal = Counter(f"{x.signal}:{x.severity}" for x in alerts if x.status == "firing")
    print(f"alerts raised: {len(alerts)} ({crit} critical), breaker trips: {opened}; firing by signal: "
          + (", ".join(f"{s} {n}" for s, n in by_signal.most_common()) or "none"))
    cur, peak, not_full = measure_memory(a.domains, a.k)
    print(f"memory, {a.domains} domains with full windows and consistency maps "
          f"({f'{not_full} domains NOT full' if not_full else 'checked'}): "
          f"current {cur:.2f} MiB ({1024 * cur / a.domains:.0f} KiB per domain), "
          f"peak {peak:.2f} MiB ({1024 * peak / a.domains:.0f} KiB per domain)")


if __name__ == "__main__":
    main()
