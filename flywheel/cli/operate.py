"""The operator's commands against a running scheduler: ``flywheel submit`` (tasks from JSONL), ``domains``
(per-domain status and spend), ``alerts`` (the drift monitor's) and ``control`` (an operator command, over
REST or straight onto flywheel.control)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import orjson
import typer

from flywheel.cli.client import _call, _target, scheduler_client, submit_tasks
from flywheel.cli.common import COMMAND_RETRY_S, RetryOpt, SystemDirOpt, UrlOpt, _read_jsonl, console, print_table
from shared.client import ApiError


def submit_cmd(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL: one task per line.")],
               url: Annotated[Optional[str], typer.Option(help="Scheduler URL (default: the running system's).")] = None,
               run_dir: SystemDirOpt = None, retry: RetryOpt = 120.0) -> None:
    """Post tasks from a JSONL file to a running system (with its token; retried through a restart)."""
    url, token = _target(url, run_dir)
    try:
        with scheduler_client(url, token, retry_s=retry) as api:
            ids = submit_tasks(api, _read_jsonl(file))
    except ApiError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    console.print(f"submitted {len(ids)} tasks")


def domains_cmd(run_dir: SystemDirOpt = None,
                url: Annotated[Optional[str], typer.Option(help="Scheduler URL (default: the running system's).")] = None,
                json_: Annotated[bool, typer.Option("--json", help="Print GET /v1/domains as JSON.")] = False,
                retry: RetryOpt = COMMAND_RETRY_S) -> None:
    """Show the running system's domains: status, weight, share, level, pass rate, tasks, spend against budget."""
    from rich.table import Table

    target_url, token = _target(url, run_dir)
    rows = _call("GET", target_url, token, "/v1/domains", retry_s=retry)
    if json_:
        typer.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    table = Table("domain", "status", "weight", "share", "level", "pass", "train/eval", "retired", "flagged",
                  "tokens", "budget left")
    for d in rows:
        spent = (d["spend"].get("train") or {}).get("generated_tokens", 0)
        table.add_row(d["domain"], d["status"], f"{d['config']['weight']:g}",
                      "-" if d["share"] is None else f"{d['share']:.3f}", f"{d['level_name']} ({d['level'] + 1}/{d['levels']})",
                      "-" if d["recent_pass_rate"] is None else f"{d['recent_pass_rate']:.2f}",
                      f"{d['tasks']['train']}/{d['tasks']['eval']}", str(d["tasks"]["retired"]),
                      str(d["tasks"]["flagged"]), f"{spent:.0f}",
                      ", ".join(f"{k} {v:g}" for k, v in d["budget_left"].items()) or "-")
    print_table(table)


def _alert_rows(reply: dict, active_only: bool) -> list[tuple[bool, dict]]:
    """``(active, alert)`` rows of a ``GET /v1/alerts`` reply: the active alerts first, then the recent
    records that are not one of them (newest first)."""
    active = reply["active"]
    seen = {(a["key"], a["time"], a["status"]) for a in active}
    rows = [(True, a) for a in active]
    if not active_only:
        rows += [(False, a) for a in reply["recent"] if (a["key"], a["time"], a["status"]) not in seen]
    return rows


def alerts_cmd(run_dir: SystemDirOpt = None, url: UrlOpt = None,
               active: Annotated[bool, typer.Option("--active", help="Only the alerts firing now.")] = False,
               domain: Annotated[Optional[str], typer.Option(help="Only this domain's alerts.")] = None,
               severity: Annotated[Optional[str], typer.Option(help="info, warning or critical.")] = None,
               signal_: Annotated[Optional[str], typer.Option("--signal", help="Only this signal's alerts.")] = None,
               limit: Annotated[int, typer.Option(help="Newest records of the history to show.")] = 100,
               json_: Annotated[bool, typer.Option("--json", help="Print GET /v1/alerts as JSON.")] = False,
               retry: RetryOpt = COMMAND_RETRY_S) -> None:
    """Show the drift monitor's alerts: those firing now first, then the newest records (firing and resolved)."""
    from rich.table import Table

    params = {k: v for k, v in {"domain": domain, "severity": severity, "signal": signal_, "limit": limit}.items()
              if v is not None}
    reply = _call("GET", *_target(url, run_dir), "/v1/alerts", retry_s=retry, params=params)
    if json_:
        out = {"active": reply["active"]} if active else reply
        typer.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return

    def num(x) -> str:
        return "-" if x is None else f"{x:.3g}"

    colour = {"critical": "red", "warning": "yellow", "info": "cyan"}
    table = Table(title="alerts (active first)" if not active else "active alerts")
    for col in ("time", "key", "severity", "status", "value", "threshold", "reference", "window", "version"):
        table.add_column(col, no_wrap=True)
    table.add_column("message", ratio=1, min_width=30)
    for is_active, a in _alert_rows(reply, active):
        sev = f"[{colour.get(a['severity'], 'white')}]{a['severity']}[/]"
        table.add_row(time.strftime("%m-%d %H:%M:%S", time.localtime(a["time"])), a["key"], sev,
                      "[bold]active[/]" if is_active else a["status"], num(a.get("value")), num(a.get("threshold")),
                      num(a.get("reference")), f"{a['window']} {a['window_unit']}" if a.get("window") else "-",
                      str(a.get("policy_version", 0)), a["message"])
    print_table(table)


def control_cmd(
    command: Annotated[str, typer.Argument(help="pause_domain, resume_domain, open_breaker, close_breaker, "
                                                "set_threshold, pause_training or resume_training.")],
    domain: Annotated[Optional[str], typer.Option(help="The domain (required by the domain and breaker commands; "
                                                       "set_threshold: this domain only, else run-wide).")] = None,
    signal_: Annotated[Optional[str], typer.Option("--signal", help="set_threshold: the signal.")] = None,
    threshold: Annotated[Optional[str], typer.Option(
        help='set_threshold: a JSON object of warning, critical, min_rise, min_samples, enabled, e.g. '
             '\'{"critical": 0.9}\'.')] = None,
    reason: Annotated[str, typer.Option(help="Why (stored with the command and its alert).")] = "",
    kafka: Annotated[Optional[str], typer.Option(
        help="Publish the Control record straight onto flywheel.control at this bootstrap host:port "
             "(when the REST API is not reachable) instead of POST /v1/control.")] = None,
    run_dir: SystemDirOpt = None, url: UrlOpt = None, retry: RetryOpt = COMMAND_RETRY_S,
) -> None:
    """Send an operator command to the drift monitor: POST /v1/control (prints what changed), or with --kafka a
    Control record on flywheel.control, which the scheduler applies when it reads it."""
    if command not in _operator_commands():
        raise typer.BadParameter(f"{command!r} is not one of {', '.join(_operator_commands())}", param_hint="COMMAND")
    try:
        th = orjson.loads(threshold) if threshold is not None else None
    except orjson.JSONDecodeError as e:
        raise typer.BadParameter(f"not JSON: {e}", param_hint="--threshold") from None
    if th is not None and not isinstance(th, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="--threshold")
    body = {k: v for k, v in {"command": command, "domain": domain, "signal": signal_, "threshold": th,
                              "reason": reason or None}.items() if v is not None}
    if kafka is None:
        out = _call("POST", *_target(url, run_dir), "/v1/control", retry_s=retry, json=body)
        typer.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return
    _send_control(kafka, body)


def _operator_commands() -> list[str]:
    from typing import get_args

    from shared.schemas import ControlCommand

    return [c for c in get_args(ControlCommand) if c != "domain_state"]  # domain_state: the scheduler's own


def _send_control(bootstrap: str, body: dict) -> None:
    """Validate ``body`` as a ``Control`` record (origin ``cli``) and publish it; refused or broker unreachable:
    a red message and exit 1."""
    import asyncio

    from pydantic import ValidationError

    from shared.schemas import Control

    try:
        ctrl = Control(**body, origin="cli")
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, er['loc'])) or 'record'}: {er['msg']}" for er in e.errors())
        console.print(f"[red]refused: {why}[/]")
        raise typer.Exit(1) from None
    if ctrl.command == "set_threshold":  # the scheduler would only log its refusal: check here as it will
        from scheduler_service.config import check_overrides

        try:
            check_overrides({ctrl.signal: dict(ctrl.threshold)})
        except ValueError as e:
            console.print(f"[red]refused: threshold: {e}[/]")
            raise typer.Exit(1) from None
    try:
        asyncio.run(_publish_control(bootstrap, ctrl))
    except Exception as e:  # noqa: BLE001 - any broker trouble: say so and fail
        console.print(f"[red]could not publish on flywheel.control at {bootstrap}: {e!r}[/]")
        raise typer.Exit(1) from None
    from shared import topics

    typer.echo(orjson.dumps({"published": topics.CONTROL, "key": ctrl.key, "control_id": ctrl.control_id,
                             **ctrl.model_dump(mode="json", include={"command", "domain", "signal", "threshold",
                                                                     "reason", "origin"})},
                            option=orjson.OPT_INDENT_2).decode())


async def _publish_control(bootstrap: str, ctrl) -> None:
    """Send ``ctrl`` on flywheel.control (key: its domain or ``run``) and wait for the ack."""
    import asyncio

    from shared import topics
    from shared.config import KafkaConfig
    from shared.kafka import make_producer, send

    producer = make_producer(KafkaConfig(bootstrap_servers=bootstrap), client_id="flywheel-cli")
    await asyncio.wait_for(producer.start(), 30)
    try:
        await asyncio.wait_for(await send(producer, topics.CONTROL, ctrl, key=ctrl.key), 30)
    finally:
        await producer.stop()
