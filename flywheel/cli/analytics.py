"""``flywheel analytics``: ingest the topics into DuckDB (the default command, and ``ingest``) and run SQL
or a documented question on it (``query``); the work itself is in :mod:`flywheel.analytics`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import orjson
import typer

from flywheel.cli.common import _state, console, print_table


analytics_app = typer.Typer(help="The topics in DuckDB: `flywheel analytics` ingests (incrementally, no "
                                 "duplicates), `flywheel analytics query SQL` asks.")

DbOpt = Annotated[Optional[Path], typer.Option(help="The DuckDB file (default: <run dir>/analytics.duckdb).")]

AnalyticsRunDirOpt = Annotated[Optional[Path], typer.Option(
    help="Run directory (default: the running system's, from .flywheel/current.json).")]

BootstrapOpt = Annotated[Optional[str], typer.Option(
    help="Kafka bootstrap host:port (default: the running system's, from <run dir>/flywheel.json).")]

FollowOpt = Annotated[bool, typer.Option("--follow", help="Keep reading new records until Ctrl-C.")]

BatchOpt = Annotated[int, typer.Option(min=1, help="Records per transaction at most.")]

VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="One line per committed batch.")]


@analytics_app.callback(invoke_without_command=True)
def analytics_cmd(ctx: typer.Context, run_dir: AnalyticsRunDirOpt = None, bootstrap: BootstrapOpt = None,
                  follow: FollowOpt = False, db: DbOpt = None, batch_size: BatchOpt = 5000,
                  verbose: VerboseOpt = False) -> None:
    """Ingest tasks, rewards, metrics (and evals), alerts, group drops and control records into DuckDB (the
    default command; same as `flywheel analytics ingest`)."""
    if ctx.invoked_subcommand is None:
        _analytics_ingest(run_dir, bootstrap, follow, db, batch_size, verbose)


@analytics_app.command("ingest")
def analytics_ingest(run_dir: AnalyticsRunDirOpt = None, bootstrap: BootstrapOpt = None, follow: FollowOpt = False,
                     db: DbOpt = None, batch_size: BatchOpt = 5000, verbose: VerboseOpt = False) -> None:
    """Ingest the topics into DuckDB from where the last ingest stopped; stop at their end unless --follow."""
    _analytics_ingest(run_dir, bootstrap, follow, db, batch_size, verbose)


def _analytics_db(db: Path | None, run_dir: Path | None) -> Path:
    return db or (run_dir or Path(_state(None)["run_dir"])) / "analytics.duckdb"


def _analytics_ingest(run_dir: Path | None, bootstrap: str | None, follow: bool, db: Path | None, batch_size: int,
                      verbose: bool) -> None:
    """`flywheel analytics [ingest]`: resolve the broker and the file, ingest, print the rows added per table;
    a replaced log, a locked file or an unreachable broker: a red message and exit 1."""
    import asyncio

    import duckdb
    from aiokafka.errors import KafkaError

    from flywheel.analytics.ingest import LogChangedError, ingest
    from flywheel.analytics.store import Store
    from shared.config import KafkaConfig
    from shared.kafka import install_stop_signals

    if bootstrap is None:
        st = _state(run_dir)
        bootstrap, run_dir = st["bootstrap_servers"], run_dir or Path(st["run_dir"])
    store = Store(_analytics_db(db, run_dir))

    def progress(rep) -> None:
        console.print(f"batch {rep.batches}: {rep.records} records read, rows added {rep.added}")

    async def go():
        stop = asyncio.Event()
        install_stop_signals(stop)
        return await ingest(store, KafkaConfig(bootstrap_servers=bootstrap), follow=follow, stop=stop,
                            batch_records=batch_size, on_batch=progress if verbose else None)

    try:
        rep = asyncio.run(go())
        totals = store.counts()
    except (LogChangedError, duckdb.Error, KafkaError, OSError) as e:
        console.print(f"[red]analytics ingest into {store.path} failed: {e}[/]")
        raise typer.Exit(1) from None
    finally:
        store.close()
    console.print(f"{rep.records} records read in {rep.seconds:.1f} s ({rep.batches} batches) into {store.path}")
    for name, total in totals.items():
        console.print(f"  {name:<12} +{rep.added.get(name, 0):<8} {total} rows")


@analytics_app.command("query")
def analytics_query(
    sql: Annotated[str, typer.Argument(help="SQL (read-only), or the name of a documented question: "
                                            "pass_rate_by_version, reward_histogram, length_inflation, hack_rate, "
                                            "cost_per_domain, heldout_accuracy.")],
    db: DbOpt = None, run_dir: AnalyticsRunDirOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="One JSON object per row (JSON lines).")] = False,
) -> None:
    """Run SQL on the analytics database and print a table (or JSON lines). Tables: tasks, rewards, metrics,
    alerts, group_drops, control, rejected, ingest_offsets; views: samples, evals, metrics_wide."""
    from decimal import Decimal

    import duckdb
    from rich.table import Table

    from flywheel.analytics.queries import query

    try:
        cols, rows = query(_analytics_db(db, run_dir), sql)
    except (FileNotFoundError, duckdb.Error) as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    if json_:
        for row in rows:
            typer.echo(orjson.dumps(dict(zip(cols, row)),
                                    default=lambda o: float(o) if isinstance(o, Decimal) else str(o)).decode())
        return
    table = Table(*cols)
    for row in rows:
        table.add_row(*("NULL" if v is None else str(v) for v in row))
    print_table(table)
    console.print(f"{len(rows)} rows")
