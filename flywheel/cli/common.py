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
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

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
    """The root config of ``config`` with the ``--set`` overrides, and the overrides as environment variables.

    A config that does not validate (an unknown or moved field, a value out of bounds, a domain whose fields do
    not go together) or a malformed override stops the command here with one line per error, each naming the
    field (exit 2, as the environment errors of ``flywheel run``), not with pydantic's traceback."""
    try:
        env = overrides_to_env(sets or [])
    except ValueError as e:
        raise config_error(config, [str(e)]) from None
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_config(config), env
    except ValidationError as e:
        raise config_error(config, validation_lines(e)) from None
    except (ValueError, yaml.YAMLError) as e:  # a top level that is no mapping, overlapping env vars, bad YAML
        raise config_error(config, [" ".join(str(e).split())]) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def validation_lines(e: ValidationError) -> list[str]:
    """One line per error of ``e``: the field's dotted path (when the error has one) and pydantic's message
    without its ``Value error, `` prefix (a validator's own message is the whole explanation)."""
    out = []
    for er in e.errors():
        msg = er["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        loc, msg = ".".join(map(str, er["loc"])), " ".join(msg.split())
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


def config_error(config: Path | None, lines: list[str]) -> typer.Exit:
    """Print ``lines`` in red, one per error, each naming the config file, and give the exit (2) to raise."""
    for line in lines:
        console.print(f"[red]{escape(f'invalid config {config}: ' if config else 'invalid config: ')}"
                      f"{escape(line)}[/]")
    return typer.Exit(2)


NON_TERMINAL_WIDTH = 240
"""Columns a table may take when stdout is not a terminal (a pipe, a log file, CI), where rich would otherwise fit
it into 80 and cut every cell short (``flywheel domains | grep`` would not find a long domain name)."""


def print_table(table) -> None:
    """Print a rich table: as wide as the terminal on one, else up to :data:`NON_TERMINAL_WIDTH` columns."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(width=NON_TERMINAL_WIDTH, soft_wrap=True, file=console.file).print(table)


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
