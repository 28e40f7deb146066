"""Intra-op threads that follow the machine's idle cores (``torch_threads`` / ``burst_threads`` of a service).

On one machine the services share the cores: in the main job the rollout and the trainer get one core each
(``torch_threads: 1``), but each is idle part of the time (the rollout waits on the staleness budget while the
trainer steps; the trainer waits for data while the rollout generates). A fixed second thread does not pay:
a 2-thread trainer step beside a busy 1-thread process took 10.8-13 s against 6.3 s with one thread (OpenMP's
barriers wait on the descheduled thread). :class:`CoreBurst` instead reads what the *other* processes use
(``/proc/stat`` of the cores this process may run on, less this process's own CPU time) over a short window
and sets ``torch.set_num_threads`` between ``base`` and ``burst``: the cores nobody else used, rounded.
:func:`attach` calls it before every decoder layer's forward and backward, so a service gives a core back
within one layer (tens of ms) of another one starting to work.

No coordination between services is needed, and any other load on the machine (a test run, the broker)
counts. Where ``/proc/stat`` is missing (not Linux) the thread count stays at ``base``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

log = logging.getLogger(__name__)

PROC_STAT = "/proc/stat"


def _cpu_ticks(cpus: set[int], path: str = PROC_STAT) -> tuple[int, int]:
    """``(busy, total)`` clock ticks (USER_HZ) summed over the cores ``cpus``, from ``/proc/stat``.

    Busy is everything but idle and iowait; total includes them (steal and guest columns are left out).

    Raises:
        OSError: the file cannot be read.
    """
    busy = total = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.startswith(b"cpu") or line[3:4] == b" ":
                continue
            name, *vals = line.split()
            if int(name[3:]) not in cpus:
                continue
            v = [int(x) for x in vals[:7]]  # user nice system idle iowait irq softirq
            busy += v[0] + v[1] + v[2] + v[5] + v[6]
            total += sum(v)
    return busy, total


class CoreBurst:
    """Decides this process's intra-op thread count from the cores other processes leave idle.

    Every call of :meth:`update` (cheap: a clock read) re-decides at most once per ``window_s`` seconds:
    ``other`` = cores used by other processes over the window (``/proc/stat`` busy ticks of this process's
    allowed cores, less this process's CPU seconds), ``threads = clamp(round(n_cores - other - slack), base,
    burst)`` with ``slack`` = 0.25 core (the broker and the services' event loops), then
    ``torch.set_num_threads(threads)`` if it changed.

    Args:
        base: the thread count when the other cores are busy (``torch_threads``), ≥ 1.
        burst: the most threads (``burst_threads``); ``burst <= base`` turns bursting off.
        window_s: seconds of history per decision (≥ 0.02; ``/proc/stat`` counts in 10 ms ticks).
        set_threads: sets the thread count (default ``torch.set_num_threads``; a test passes its own).
        stat_path: the ``/proc/stat`` to read (a test passes a file).
        process_time: this process's CPU seconds, all threads (default :func:`time.process_time`).
        clock: monotonic seconds (default :func:`time.monotonic`).

    Attributes:
        threads: the current thread count.
        changes: how many times it changed (a counter for metrics and tests).
    """

    SLACK = 0.25

    def __init__(self, base: int, burst: int, window_s: float = 0.1, set_threads: Callable[[int], None] | None = None,
                 stat_path: str = PROC_STAT, process_time: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if base < 1:
            raise ValueError(f"base threads must be >= 1, got {base}")
        if window_s < 0.02:
            raise ValueError(f"window_s must be >= 0.02 s, got {window_s}")
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.base, self.burst = base, max(base, burst)
        self.window_s = window_s
        self._set = set_threads
        self._stat_path = stat_path
        self._process_time = process_time
        self._clock = clock
        self.cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = base
        self.changes = 0
        self.enabled = self.burst > base
        self._last: tuple[float, int, float] | None = None  # (monotonic s, busy ticks, own CPU s)
        if self.enabled:
            try:
                self._sample()
            except (OSError, ValueError) as e:  # not Linux, or an unreadable /proc: stay at base
                log.warning("burst threads off: %s is unreadable (%r)", stat_path, e)
                self.enabled = False

    def _sample(self) -> tuple[float, int, float]:
        busy, _ = _cpu_ticks(self.cpus, self._stat_path)
        self._last = (self._clock(), busy, self._process_time())
        return self._last

    def other_cores(self) -> float | None:
        """Cores used by other processes since the last sample (and take a new sample); None before a window
        has passed."""
        assert self._last is not None
        t0, busy0, own0 = self._last
        now = self._clock()
        if now - t0 < self.window_s:
            return None
        now, busy1, own1 = self._sample()
        dt = now - t0
        return max(0.0, (busy1 - busy0) / self.hz - (own1 - own0)) / dt

    def update(self) -> int:
        """Re-decide the thread count if a window has passed; returns the current count."""
        if not self.enabled:
            return self.threads
        other = self.other_cores()
        if other is None:
            return self.threads
        want = min(self.burst, max(self.base, int(len(self.cpus) - other - self.SLACK + 0.5)))
        if want != self.threads:
            self._set(want)
            self.threads = want
            self.changes += 1
        return self.threads

    def __call__(self, *_args) -> None:
        """:meth:`update`, with any arguments ignored (so it can be a module or tensor hook)."""
        self.update()


def attach(model, burst: CoreBurst) -> list:
    """Call ``burst`` before the forward of every decoder layer of ``model`` (``model.model.layers``, the
    transformers layout; else every direct child of the first ``ModuleList`` found) and, when the layer's output
    requires grad, before its backward. Returns the hook handles (``.remove()`` them to detach); nothing is
    attached when bursting is off.
    """
    import torch

    if not burst.enabled:
        return []
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [])

    def before_backward(_grad) -> None:  # returns None: the gradient passes unchanged
        burst.update()

    def after(_mod, _inp, out) -> None:
        h = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(h, torch.Tensor) and h.requires_grad:
            h.register_hook(before_backward)  # the layer's backward starts once this gradient exists

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(burst))
        handles.append(layer.register_forward_hook(after))
    return handles
