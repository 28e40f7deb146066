"""``flywheel``: run a training job end to end, or start, feed, inspect and stop a local system.

    flywheel run examples/arithmetic.yaml --report runs/arithmetic.json
    flywheel up examples/arithmetic.yaml        # serve until Ctrl-C or `flywheel down`
    flywheel job examples/arithmetic.yaml --url http://scheduler:8000   # the job on a system run elsewhere (compose)
    flywheel submit tasks.jsonl                 # one task object per line (format in docs/getting-started.md)
    flywheel status
    flywheel domains                            # per domain: status, share, level, pass rate, spend vs budget
    flywheel alerts [--active] [--domain D] [--severity S] [--json]   # the drift monitor's alerts, firing first
    flywheel control open_breaker --domain D    # operator commands (POST /v1/control, or --kafka host:port)
    flywheel down
    flywheel tasks geometry -n 100 > geometry.jsonl   # a shipped domain's generated tasks as JSONL
    flywheel judge-calibrate labelled.jsonl --config cfg.yaml   # the judge's agreement with labels
    flywheel budget examples/arithmetic.yaml [--history runs/arithmetic.json] [--json]   # a run's rollout cost, before it
    flywheel analytics [--follow]               # the topics into <run dir>/analytics.duckdb (incremental)
    flywheel analytics query "SELECT ..." [--json]   # SQL on it (or a documented question by name)
    flywheel env check --path envs/my_env.py [--args '{"n": 50}'] [--rows N] [--score TEXT]   # an environment, no run
    flywheel export runs/arithmetic-20261208-011600 out/ [--version N] [--force]   # a version as a HF folder
    flywheel sft cfg.yaml                       # supervised fine-tuning on chat transcripts (its `sft:` section)

The typer ``app`` is assembled here from the command groups: :mod:`~flywheel.cli.train` (``run``, ``job``),
:mod:`~flywheel.cli.system` (``up``, ``down``, ``status``, ``prepare``), :mod:`~flywheel.cli.operate`
(``submit``, ``domains``, ``alerts``, ``control``), :mod:`~flywheel.cli.tools` (``tasks``, ``budget``,
``judge-calibrate``), :mod:`~flywheel.cli.analytics`, :mod:`~flywheel.cli.env` (``env check``),
:mod:`~flywheel.cli.export` (``export``), :mod:`~flywheel.cli.sft` (``sft``) and ``clean`` (:mod:`flywheel.clean`);
what they share is in :mod:`~flywheel.cli.common` and :mod:`~flywheel.cli.client`.
"""

from __future__ import annotations

import typer

from flywheel.clean import clean_cmd
from flywheel.cli.analytics import analytics_app
from flywheel.cli.env import env_app
from flywheel.cli.export import export_cmd
from flywheel.cli.operate import alerts_cmd, control_cmd, domains_cmd, submit_cmd
from flywheel.cli.sft import sft
from flywheel.cli.system import down, prepare, status, up
from flywheel.cli.tools import budget_cmd, judge_calibrate, tasks_cmd
from flywheel.cli.train import job, run

app = typer.Typer(add_completion=False, help="Flywheel: asynchronous RL post-training over Kafka.")
app.command()(run)
app.command()(up)
app.command()(job)
app.command("submit")(submit_cmd)
app.command()(prepare)
app.command()(status)
app.command("domains")(domains_cmd)
app.command("alerts")(alerts_cmd)
app.command("control")(control_cmd)
app.command()(down)
app.command("clean")(clean_cmd)  # flywheel/clean.py: free finished runs' checkpoints
app.command("tasks")(tasks_cmd)
app.command("budget")(budget_cmd)
app.command("judge-calibrate")(judge_calibrate)
app.command("export")(export_cmd)  # flywheel/export.py: a version as a Hugging Face folder
app.command()(sft)  # trainer_service/sft.py: supervised fine-tuning before RL
app.add_typer(analytics_app, name="analytics")
app.add_typer(env_app, name="env")
