"""A warm sandbox worker: one per slot, started by :mod:`sandbox_service.pool`, one run at a time.

Process tree of one run (``S`` = the service, ``W`` = this worker, set up once)::

    S --pipes--> W  own mount/net/ipc/uts namespaces; read-only root prepared; modules pre-imported;
                 │  supervises each run but never sees a request (hygiene, see below)
                 └─ R  cloned *before* the request arrives, straight into new pid, mount and IPC
                    │  namespaces (pid 1 there), in a session of its own. R reads the request itself
                    │  from S's pipe and sets the run up: slot cgroup limits, fresh size-limited
                    │  tmpfs /work and /tmp, /proc, pivot_root into the read-only root. Then it stays
                    │  as init (feeding stdin; in test-harness mode, running the tests)
                    └─ C  forked by R before the request existed; confines itself (rlimits, slot uid,
                          no_new_privs, Landlock, seccomp) and runs the code (in the pre-imported
                          interpreter for Python; ``execve`` for bash, C, C++)

W learns only the run's limits (numbers) from R, enforces the wall deadline (SIGKILL to R takes
the whole pid namespace with it), reads stdout, stderr and the test-result channel into byte
buffers that it zeroes after the run, empties the cgroup, and writes one result frame to S. The
request (code, tests, stdin) never enters W's memory, and outputs only as zeroed byte buffers, so
nothing of one run can be found in the heap that the next run is cloned from; C never held the
request at all.

Frames on the S<->W pipes: a 4-byte big-endian length and an orjson object; a result frame is
followed by its raw parts (stdout, stderr, results channel, set-up error), their lengths in the
header's ``parts``. Each layer is applied only when the start-up probe found it working and the
service did not switch it off; the service reports the rest as ``degraded``.

This module is W's entry point (the pool starts it with ``-m``); W's fixed state and its set-up are
:mod:`sandbox_service.slot`, its side of each run :mod:`sandbox_service.supervise`, and what R and C do
:mod:`sandbox_service.run_process`.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys

from sandbox_service.slot import Worker
from sandbox_service.supervise import serve, write_frame


def main() -> None:
    """``python -m sandbox_service.worker --slot S --layers ...`` (started by the pool, not by users)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--uid", type=int, default=None)
    ap.add_argument("--layers", default="")
    ap.add_argument("--cgroup", default=None)
    ap.add_argument("--landlock-abi", type=int, default=0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cpu-cores", type=float, default=1.0)
    a = ap.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops workers by closing the pipe or SIGKILL
    w = Worker(a.slot, a.uid, [x for x in a.layers.split(",") if x], a.cgroup, a.landlock_abi, a.python, a.cpu_cores)
    try:
        w.setup()
    except BaseException as e:  # noqa: BLE001
        write_frame(1, {"ready": False, "error": f"worker set-up failed: {type(e).__name__}: {e}"})
        shutil.rmtree(w.scratch, ignore_errors=True)
        sys.exit(1)
    serve(w)


if __name__ == "__main__":
    main()
