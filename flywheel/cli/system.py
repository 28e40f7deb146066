"""``flywheel up``, ``down``, ``status`` and ``prepare``: start a local system and keep it supervised, stop
it by pid, show its processes and the scheduler's status, and convert the model ahead of a job; also the
start and stop that ``flywheel run`` shares (:func:`_start`, :func:`_stop`)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Annotated, Optional

import orjson
import typer

from flywheel.cli.client import SchedulerApi, _call, _token_for, submit_tasks
from flywheel.cli.common import ConfigArg, RetryOpt, RunDirOpt, SetOpt, SystemDirOpt, _load, _pointer, _read_jsonl, _state, console
from flywheel.run_config import save_run_config
from flywheel.launcher import LocalSystem
from shared.config import ModelConfig
from shared.model import SMOLLM2, resolve_model_dir


def _start(config: Path, sets: list[str] | None, run_dir: Path | None, fresh: bool) -> tuple[LocalSystem, object]:
    cfg, env = _load(config, sets)
    base = Path(os.path.expanduser(cfg.run.dir))
    if run_dir is None:
        run_dir = base / (f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}" if fresh else "system")
    with console.status("preparing the model (converted once, then cached)"):
        resolve_model_dir(cfg.model.name, cfg.model.cache_dir)
    with console.status("starting the broker and five services"):
        system = LocalSystem.start(config, run_dir, env)
    try:  # the config that trained the run, for `flywheel export`'s model card
        save_run_config(system.run_dir, cfg)
    except OSError as e:
        console.print(f"[yellow]the run's config was not saved in the run directory: {e}[/]")
    _pointer().parent.mkdir(parents=True, exist_ok=True)
    _pointer().write_bytes((system.run_dir / "flywheel.json").read_bytes())
    console.print(f"[green]system up[/]: scheduler {system.scheduler_url} (docs at /docs, dashboard at "
                  f"{system.scheduler_url}/dashboard), "
                  f"broker {system.env['FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS']}, run dir {system.run_dir}")
    if system.precision:
        console.print("precision: " + ", ".join(f"{k} {p['dtype']}" for k, p in system.precision.items())
                      + f" ({next(iter(system.precision.values()))['hardware']})")
    return system, cfg


def _stop(system: LocalSystem) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the teardown short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with console.status("stopping"):
        system.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def up(config: ConfigArg, set_: SetOpt = None, run_dir: RunDirOpt = None,
       submit: Annotated[Optional[Path], typer.Option(help="Also submit this JSONL task file.")] = None) -> None:
    """Start the broker and the five services and keep them running (supervised) until Ctrl-C or `flywheel down`."""
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)  # `flywheel down` sends SIGTERM
    system, cfg = _start(config, set_, run_dir, fresh=False)
    try:
        if submit:
            api = SchedulerApi(system, _token_for(system.run_dir, cfg), 300.0)
            try:  # supervised while it retries: a scheduler that dies meanwhile is restarted
                ids = submit_tasks(api.client, _read_jsonl(submit))
            finally:
                api.close()
            console.print(f"submitted {len(ids)} tasks")
        while True:
            for note in system.check():
                console.print(f"[yellow]{note}[/]")
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(system)
        console.print("system stopped")


def down(run_dir: SystemDirOpt = None, timeout: float = 60.0) -> None:
    """Stop the running system (signals its supervisor, which stops every process by pid)."""
    st = _state(run_dir)
    pid = st["supervisor_pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    # supervisor gone: clean up what is left (on Linux its children end with it: launcher's die_with_parent)
    leftovers = [(st["broker_pid"], "tansu"), *((p, f"{n}_service") for n, p in st["services"].items())]
    for other, marker in leftovers:
        if _still(other, marker):
            os.kill(other, signal.SIGTERM)
    if run_dir is None:
        _pointer().unlink(missing_ok=True)
    console.print("stopped")


def _still(pid: int | None, marker: str) -> bool:
    """``pid`` is alive and, where ``/proc`` shows its command line, still the process it was: the line holds
    ``marker`` (``tansu``, ``<name>_service``). A pid the kernel has since given to another process is left
    alone."""
    if not _alive(pid):
        return False
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # gone meanwhile, or no /proc (not Linux): trust the pid there
        return not os.path.isdir("/proc")
    except OSError:
        return False


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def prepare(config: Annotated[Optional[Path], typer.Argument(help="A job config (its model); default: SmolLM2.")] = None,
            set_: SetOpt = None) -> None:
    """Convert and cache the config's model now (SmolLM2's GGUF becomes a transformers directory, about 25 s
    once), so that a job's ``wall_seconds`` measures the job. ``scripts/install.sh`` runs it."""
    name, cache = SMOLLM2, ModelConfig().cache_dir
    if config is not None:
        cfg, _ = _load(config, set_)
        name, cache = cfg.model.name, cfg.model.cache_dir
    t0 = time.monotonic()
    path = resolve_model_dir(name, cache)
    console.print(f"model {name}: {path} ({time.monotonic() - t0:.1f} s)")


def status(run_dir: SystemDirOpt = None, retry: RetryOpt = 5.0) -> None:
    """Show the running system's processes and the scheduler's status."""
    st = _state(run_dir)
    for name, pid in {"supervisor": st["supervisor_pid"], "broker": st["broker_pid"], **st["services"]}.items():
        console.print(f"{name:<11} pid {pid}: {'[green]running[/]' if _alive(pid) else '[red]gone[/]'}")
    console.print(f"dashboard   {st['scheduler_url']}/dashboard")
    out = _call("GET", st["scheduler_url"], _token_for(st.get("run_dir")), "/v1/status", retry_s=retry)
    console.print_json(orjson.dumps(out).decode())
