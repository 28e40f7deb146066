"""Fixtures shared by every test: the real embedded broker and a Kafka config pointing at it."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from flywheel.broker import EmbeddedBroker, die_with_parent, free_port, stop_pid
from shared.config import KafkaConfig


E2E_DIR = Path(__file__).resolve().parent / "e2e"
"""Whole-system tests: every test under it is marked ``e2e`` (their own tier: ``pytest -m "e2e and not slow"``)."""


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests under ``tests/e2e/`` ``e2e``: the default run (``-m 'not slow and not e2e'``) leaves them
    to the e2e tier."""
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


DEFAULT_TIER = "not slow and not e2e"
"""The default tier's marker expression (``addopts`` in pyproject.toml)."""
MAX_WORKERS = 4
"""Most test processes of ``-n auto``: most default-tier tests wait on a broker, a sandbox or a timeout rather
than compute, but each starts processes of its own."""


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's ``addopts``): the default tier runs one test file per core (``--dist loadfile``
    keeps a module's fixtures in one process), up to :data:`MAX_WORKERS`; any other tier (e2e, slow: each test
    takes the whole machine) runs one test at a time. An explicit ``-n N`` wins."""
    if (config.getoption("markexpr") or "").strip() != DEFAULT_TIER:
        return 0
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


SESSION_ENV = "FLYWHEEL_TEST_SESSION"
"""Environment variable every process started by a test run inherits: its value names the run, so processes it
left behind are found even after their parent died and they were re-parented."""
OWN_HELPERS = (b"multiprocessing.resource_tracker",)
"""Processes the test run's own interpreter keeps until it exits (the ``spawn`` context's resource tracker):
not left behind by a test."""


def _processes_of(session: str) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes whose environment carries ``SESSION_ENV=session``."""
    found, needle = [], f"{SESSION_ENV}={session}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            if any(helper in cmdline for helper in OWN_HELPERS):
                continue
            found.append((int(entry.name), cmdline.decode(errors="replace")[:200]))
        except (OSError, IndexError):
            continue  # gone meanwhile, or another user's (a sandboxed child)
    return found


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_run():
    """Set up first and torn down last: when the tier ends (the session broker and sandbox stopped), no process
    this run started may still live. One that does is killed and named, and the run errors."""
    session = uuid.uuid4().hex
    os.environ[SESSION_ENV] = session
    yield
    deadline = time.monotonic() + 15  # a process being stopped right now gets its grace
    while (left := _processes_of(session)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left running when the test run ended: {left}"


@pytest.fixture(scope="session")
def broker():
    """One Tansu broker (memory storage, free loopback port) for the session, stopped by pid at the end."""
    b = EmbeddedBroker.start(with_parent=True)  # gone with the test run, even if it is killed
    try:
        yield b
    finally:
        b.stop()
    assert b.process.poll() is not None


@pytest.fixture
def float32_numerics(monkeypatch):
    """``auto`` precision resolves to float32 in this test, whatever the CPU (``FLYWHEEL_NATIVE_BF16=0``): for tests
    that compare the trainer's or the engine's numbers with a float32 or float64 reference. The per-process
    probe is cleared before and after."""
    from shared.precision import ENV, probe_bf16

    monkeypatch.setenv(ENV, "0")
    probe_bf16.cache_clear()
    yield
    probe_bf16.cache_clear()


@pytest.fixture
def kafka_cfg(broker) -> KafkaConfig:
    """Kafka settings for the session broker (2 partitions to keep tests quick)."""
    return KafkaConfig(bootstrap_servers=broker.bootstrap_servers, partitions=2)


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic names, consumer groups and ids, so tests never share state."""
    return uuid.uuid4().hex[:8]


async def _read_topic(cfg: KafkaConfig, topic: str, cls, want: int, timeout_s: float = 60.0, keep=None,
                      until=None, expect: int | None = None, settle_s: float = 3.0) -> list:
    """Decode records of ``cls`` from ``topic`` (no group, from the earliest offset).

    Keeps those passing ``keep`` (all when None) until ``want`` are kept, or with ``until`` until a
    kept record satisfies it, or the timeout. Undecodable records (other tests' garbage) are skipped.
    With ``expect`` (fewer than ``want``: to show that no more came), the read also ends ``settle_s`` seconds
    after ``expect`` were kept: a slow start of the reader cannot pass for "none more" as a short timeout can.
    """
    from shared import kafka
    from shared.schemas import DecodeError, decode

    c = kafka.make_consumer(cfg, topic, group_id=None)
    await c.start()
    out, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if (len(out) >= want) if until is None else any(map(until, out)):
                break
            if expect is not None and len(out) >= expect:
                deadline = min(deadline, time.monotonic() + settle_s)
                expect = None
            for msgs in (await c.getmany(timeout_ms=200)).values():
                for m in msgs:
                    try:
                        rec = decode(m.value, cls)
                    except DecodeError:
                        continue
                    if keep is None or keep(rec):
                        out.append(rec)
    finally:
        await c.stop()
    return out


@pytest.fixture
def read_topic():
    """``await read_topic(kafka_cfg, topic, RecordClass, want, timeout_s=60, keep=None, until=None, expect=None,
    settle_s=3)``."""
    return _read_topic


@pytest.fixture(scope="session")
def sandbox_url(tmp_path_factory):
    """The real sandbox service (``python -m sandbox_service``) on a free port, stopped by pid."""
    import os
    import subprocess
    import sys

    import httpx

    port = free_port()
    run_dir = tmp_path_factory.mktemp("sandbox")
    env = dict(os.environ, FLYWHEEL_SANDBOX__PORT=str(port), FLYWHEEL_RUN__DIR=str(run_dir))
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_service"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    _SANDBOX_RUN_DIRS[url] = run_dir
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"sandbox exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "sandbox did not become healthy in 30 s"
            time.sleep(0.2)
        yield url
    finally:
        stop_pid(proc)


@pytest.fixture(autouse=True)
def _sandbox_token(request, monkeypatch):
    """For a test that uses ``sandbox_url`` only: ``$FLYWHEEL_AUTH__TOKEN_FILE`` names that sandbox's token
    (written to its run dir at start-up), which in-process clients (ToolRunner, Scorer) read. Set per test,
    never for the session: settings loaded by other tests would adopt it."""
    if "sandbox_url" in request.fixturenames:
        run_dir = _SANDBOX_RUN_DIRS.get(request.getfixturevalue("sandbox_url"))
        if run_dir is not None:  # None: a module's own ``sandbox_url`` fixture, which handles its token itself
            monkeypatch.setenv("FLYWHEEL_AUTH__TOKEN_FILE", str(run_dir / "auth_token"))


_SANDBOX_RUN_DIRS: dict = {}
