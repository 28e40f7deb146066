"""shared/threads.py: the intra-op thread count follows the cores other processes leave idle."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
import torch

from shared.threads import CoreBurst, _cpu_ticks, attach

CPUS = sorted(os.sched_getaffinity(0))


class FakeMachine:
    """A ``/proc/stat`` file, a clock and this process's CPU time, all advanced by hand."""

    def __init__(self, path) -> None:
        self.path, self.t, self.own, self.busy = str(path), 0.0, 0.0, {c: 0 for c in CPUS}
        self.write()

    def write(self) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]  # the aggregate line is ignored (only the allowed cores count)
        lines += [f"cpu{c} {b} 0 0 {10_000 - b} 0 0 0 0 0 0" for c, b in self.busy.items()]
        lines += [f"cpu{max(CPUS) + 1} 9999 0 0 0 0 0 0 0 0 0"]  # a core this process may not use: ignored
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\nintr 1 2 3\n")

    def advance(self, seconds: float, other_cores: float, own_cores: float = 1.0) -> None:
        """``seconds`` pass with other processes using ``other_cores`` and this one ``own_cores``."""
        self.t += seconds
        self.own += own_cores * seconds
        ticks = round((other_cores + own_cores) * seconds * 100)
        self.busy[CPUS[0]] += ticks
        self.write()


def burst(fake: FakeMachine, base: int = 1, top: int = 2, calls: list | None = None) -> CoreBurst:
    return CoreBurst(base, top, window_s=0.1, set_threads=(calls if calls is not None else []).append,
                     stat_path=fake.path, process_time=lambda: fake.own, clock=lambda: fake.t)


def test_cpu_ticks_counts_only_the_allowed_cores(tmp_path):
    fake = FakeMachine(tmp_path / "stat")
    fake.advance(1.0, other_cores=0.5)
    busy, total = _cpu_ticks(set(CPUS), fake.path)
    assert busy == 150 and total == 10_000 * len(CPUS)


@pytest.mark.skipif(len(CPUS) != 2, reason="the thresholds below are for a 2-core machine like CI's")
def test_threads_follow_the_other_processes_load(tmp_path):
    fake, calls = FakeMachine(tmp_path / "stat"), []
    b = burst(fake, calls=calls)
    assert b.enabled and b.threads == 1
    fake.advance(0.05, other_cores=0.0)
    assert b.update() == 1 and calls == []  # less than a window: nothing decided
    fake.advance(0.1, other_cores=0.1)  # the other core idle (the broker's polls only)
    assert b.update() == 2 and calls == [2]
    fake.advance(0.2, other_cores=0.67, own_cores=1.33)  # a rollout starts beside our 2 threads
    assert b.update() == 1 and calls == [2, 1]
    fake.advance(0.2, other_cores=1.0)  # it keeps its core
    assert b.update() == 1 and calls == [2, 1]
    fake.advance(0.2, other_cores=0.2)
    assert b.update() == 2 and calls == [2, 1, 2] and b.changes == 3


def test_bursting_off_when_burst_is_not_above_base_or_stat_unreadable(tmp_path):
    fake, calls = FakeMachine(tmp_path / "stat"), []
    off = burst(fake, base=2, top=2, calls=calls)
    fake.advance(1.0, other_cores=0.0)
    assert not off.enabled and off.update() == 2 and calls == []
    missing = CoreBurst(1, 2, set_threads=calls.append, stat_path=str(tmp_path / "nope"))
    assert not missing.enabled and missing.update() == 1 and calls == []
    with pytest.raises(ValueError):
        CoreBurst(0, 2, set_threads=calls.append)
    with pytest.raises(ValueError):
        CoreBurst(1, 2, window_s=0.001, set_threads=calls.append)


def test_a_busy_process_is_seen_as_another_core_used():
    """Real /proc/stat: a child spinning on a core reads as ≥ 0.6 of a core used by others."""
    b = CoreBurst(1, 2, window_s=0.5, set_threads=lambda n: None)
    hog = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 30\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.3)
        b.other_cores()  # new sample with the hog running
        time.sleep(0.8)
        assert b.other_cores() >= 0.6
    finally:
        hog.kill()
        hog.wait()


class Counting(CoreBurst):
    def __init__(self) -> None:
        super().__init__(1, 2, set_threads=lambda n: None)
        self.enabled, self.calls = True, 0

    def update(self) -> int:
        self.calls += 1
        return self.threads


def test_attach_checks_before_every_layer_forward_and_backward_and_leaves_gradients_alone(tmp_path):
    from shared.model import build_tiny_model, load_model

    model = load_model(build_tiny_model(tmp_path / "tiny", layers=3))
    hooked = copy.deepcopy(model)
    b = Counting()
    handles = attach(hooked, b)
    assert len(handles) == 6
    ids = torch.randint(4, 50, (2, 7))
    grads = []
    for m in (model, hooked):
        m.zero_grad()
        m(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert b.calls == 6  # 3 layers: forward and backward
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    with torch.no_grad():
        hooked(input_ids=ids)
    assert b.calls == 9  # no backward without a graph
    for h in handles:
        h.remove()
    hooked(input_ids=ids)
    assert b.calls == 9
