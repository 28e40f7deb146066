"""What every ``flywheel`` command shares: the console, the typer option types, loading a config with
``--set`` overrides, and the record of the running system in the working directory
(``.flywheel/current.json``) and in its run directory (``flywheel.json``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import orjson
import typer
from rich.console import Console

from flywheel.config import load_config
from flywheel.service_env import overrides_to_env

console = Console(soft_wrap=True)  # no hard wrapping of log lines when not on a terminal
log = logging.getLogger("flywheel")

ConfigArg = Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="System config (YAML).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override, e.g. budget.max_steps=5 (repeatable).")]
RunDirOpt = Annotated[Optional[Path], typer.Option(help=(
    "Run directory (default: a new one under the config's run.dir: <run.dir>/<config name>-<date-time> for "
    "`run`, <run.dir>/system for `up`)."))]
SystemDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help=(
    "The running system's run directory (default: the one the last `up` or `run` started from this working "
    "directory recorded, .flywheel/current.json)."))]
RetryOpt = Annotated[float, typer.Option(
    min=0.0, help="Seconds the CLI keeps retrying an unreachable scheduler (a restart) before it gives up.")]
UrlOpt = Annotated[Optional[str], typer.Option(help="Scheduler URL (default: the running system's).")]

#: How long a one-shot command (submit, status, domains, alerts, control) retries an unreachable scheduler (s).
COMMAND_RETRY_S = 15.0


def _load(config: Path, sets: list[str] | None):
    env = overrides_to_env(sets or [])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_config(config), env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pointer() -> Path:
    """Where `up`/`run` record the running system for `submit`, `status` and `down` (in the working directory)."""
    return Path(os.environ.get("FLYWHEEL_STATE_DIR", ".flywheel")) / "current.json"


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                raise typer.BadParameter(f"{path}:{i}: not JSON: {e}") from None
    return out


def _state(run_dir: Path | None) -> dict:
    p = (run_dir / "flywheel.json") if run_dir else _pointer()
    if not p.exists():
        console.print(f"no running system found ({p})")
        raise typer.Exit(1)
    return orjson.loads(p.read_bytes())


def _local_run_dir(url: str) -> Path | None:
    """The run dir of the system recorded in the working directory (``.flywheel/current.json``) when its
    scheduler is at ``url``: a ``--url`` naming the local system finds its token there."""
    try:
        st = orjson.loads(_pointer().read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return Path(st["run_dir"]) if st.get("scheduler_url", "").rstrip("/") == url.rstrip("/") else None
