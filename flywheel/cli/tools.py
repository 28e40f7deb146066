"""Commands that need no running system: ``flywheel tasks`` (a shipped domain's generated tasks as JSONL),
``budget`` (a run's rollout cost, estimated before it starts) and ``judge-calibrate`` (the judge's agreement
with labels)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import orjson
import typer
from rich.console import Console

from flywheel.cli.common import ConfigArg, SetOpt, _load, console


def tasks_cmd(domain: Annotated[str, typer.Argument(help="reasoning_gym, humaneval, gsm_symbolic, "
                                                     "financial_extraction or geometry.")],
              n: Annotated[int, typer.Option("-n", help="How many tasks.")] = 100,
              split: Annotated[str, typer.Option(help="train or eval.")] = "train",
              seed: int = 0,
              params: Annotated[Optional[str], typer.Option(help="Generator parameters as a JSON object.")] = None
              ) -> None:
    """Print ``n`` generated tasks of a shipped domain as JSONL (the format of ``flywheel submit``)."""
    from flywheel.domains import make_tasks as make_domain_tasks

    try:
        kw = orjson.loads(params) if params else {}
        out = make_domain_tasks(domain, n, seed=seed, split=split, **kw)
    except (ValueError, TypeError, orjson.JSONDecodeError) as e:
        raise typer.BadParameter(str(e)) from None
    for t in out:
        typer.echo(orjson.dumps(t).decode())


def budget_cmd(
    config: ConfigArg,
    set_: SetOpt = None,
    pilot_tasks: Annotated[Optional[int], typer.Option(
        help="Training and held-out tasks of the pilot (each); default 16, or 0 (no pilot) with --history.")] = None,
    history: Annotated[Optional[Path], typer.Option(
        exists=True, dir_okay=False, help="A finished run's report (flywheel run --report): take the tokens from it.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
) -> None:
    """Estimate a run's rollout cost before it starts: trajectories x rounds x tokens per round (and tool rounds,
    sandbox seconds, judge calls) per domain, train and eval; see flywheel/budget/."""
    from flywheel.budget.costs import history_costs
    from flywheel.budget.estimate import budget_report
    from flywheel.budget.pilot import all_tasks, run_pilot
    from flywheel.budget.render import render

    try:
        cfg = _load(config, set_)[0]
        n = pilot_tasks if pilot_tasks is not None else (0 if history else 16)
        if n < 0:
            raise ValueError("--pilot-tasks must be >= 0")
        hist = history_costs(history) if history else None
        if hist:
            hist["path"] = str(history)
        tasks = all_tasks(cfg, max(n, 1))
        err = Console(stderr=True)
        with err.status(f"pilot: {n} training and {n} held-out tasks with {cfg.model.name}"):
            pilot = run_pilot(cfg, tasks, n, seed=cfg.rollout.seed) if n else None
        report = budget_report(cfg, tasks, pilot, hist, config_name=str(config))
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    if json_:
        typer.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
    else:
        render(report, console)


def judge_calibrate(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL: {prompt, response, label, rubric?}.")],
    config: Annotated[Optional[Path], typer.Option(help="System config whose verifier.judge is used.")] = None,
    set_: SetOpt = None,
    rubric: Annotated[Optional[str], typer.Option(help="Rubric for items without their own.")] = None,
    threshold: Annotated[float, typer.Option(help="Pass/fail threshold on [0, 1] scores.")] = 0.5,
) -> None:
    """Score a labelled set with the configured judge and print its agreement with the labels (JSON)."""
    import asyncio

    from flywheel.config import FlywheelConfig
    from verifier_service.judge import JudgeClient, calibrate, load_labelled

    cfg = _load(config, set_)[0] if config else FlywheelConfig()
    try:
        items = load_labelled(str(file))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None

    async def go() -> dict:
        client = JudgeClient(cfg.verifier.judge)
        try:
            return await calibrate(client, items, rubric, threshold)
        finally:
            await client.close()

    try:
        report = asyncio.run(go())
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    if report.get("infra_errors") == report.get("items"):
        raise typer.Exit(2)
