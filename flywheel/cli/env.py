"""``flywheel env check``: try a user's environment without a run.

It loads the environment exactly as the driver, the scheduler, the verifier and the rollout do
(:func:`shared.envs.load_environment`, a ``path`` made absolute first as ``flywheel run`` makes it), reads its rows
as :func:`shared.envs.load_rows` reads them for a run, makes each row the task ``flywheel run`` and the scheduler
would make of it (:func:`shared.envs.tasks.row_task`, checked against the task schema the scheduler checks), and
prints what a run would train on. With ``--score`` it scores one completion against the first row with the
rubric, given what the verifier gives a single-turn rollout's rewards. Anything wrong stops it with one line naming
the reference, module, file, attribute or column (exit 2), as ``flywheel run`` stops on its environment errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import orjson
import typer
from pydantic import ValidationError
from rich.markup import escape

from flywheel.cli.common import console, validation_lines

env_app = typer.Typer(no_args_is_help=True, help="Check a user's environment (docs/guides/environments.md).")

SHOWN_CHARS = 400
"""Longest text of a message, a system prompt or a metric shown (the rest is cut, with its length said)."""


def _fail(message: str) -> typer.Exit:
    """Print the one-line error ``message`` in red and give the exit (2) to raise."""
    console.print(f"[red]{escape(' '.join(message.split()))}[/]")
    return typer.Exit(2)


def _short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _reference(id_: str | None, module: str | None, path: str | None, args: str | None):
    """The reference the options name, its ``path`` made absolute (as ``flywheel run`` sends it).

    Raises:
        typer.Exit: (2) ``--args`` is not a JSON object, or not exactly one of ``--id``, ``--module``, ``--path``.
    """
    from shared.envs import EnvironmentRef

    try:
        kwargs = orjson.loads(args) if args is not None else {}
    except orjson.JSONDecodeError as e:
        raise _fail(f"--args is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise _fail(f"--args must be a JSON object of the loading function's keyword arguments, not "
                    f"{type(kwargs).__name__}")
    named = [f"--{k}" for k, v in (("id", id_), ("module", module), ("path", path)) if v]
    if len(named) != 1:
        raise _fail(f"give exactly one of --id, --module, --path (got {', '.join(named) or 'none'})")
    try:
        return EnvironmentRef(id=id_, module=module, path=path, args=kwargs).resolved()
    except ValidationError as e:
        raise _fail("environment " + "; ".join(validation_lines(e))) from None


def _tasks(ref, env, rows: list[dict], split: str, domain: str) -> list[dict]:
    """The task body of each row, as ``flywheel run`` and the scheduler make it and as ``POST /v1/tasks`` checks it.

    Raises:
        typer.Exit: (2) a row that makes no valid task (the message names the row and the field).
    """
    from shared.envs.tasks import row_task
    from shared.schemas import Task

    out = []
    for i, row in enumerate(rows):
        where = f"environment {ref.label()}: {'eval_dataset' if split == 'eval' else 'dataset'} row {i}"
        try:
            task = row_task(ref, env, domain, row, split)
            Task(**task)
        except ValidationError as e:
            raise _fail(f"{where} makes no valid task: {'; '.join(validation_lines(e))}") from None
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise _fail(f"{where} makes no task: {type(e).__name__}: {e}") from None
        out.append(task)
    return out


def _summary(ref, env, domain: str, train: list[dict], task: dict, held: list[dict] | None,
             limit: int | None) -> None:
    """Print what a run of ``env`` would train on: rows, columns, system prompt, tools, rubric, turns, and the
    prompt of ``task`` (the first row's)."""
    cut = f" (--rows {limit})" if limit is not None else ""
    columns = sorted({k for row in train for k in row})
    lines = [f"environment {ref.label()}: loaded, domain {domain!r}",
             f"rows: {len(train)} of dataset{cut}" + (
                 f", {len(held)} of eval_dataset" if held is not None else
                 ", no eval_dataset (held-out rows are drawn from the dataset)"),
             f"columns: {', '.join(columns)}",
             f"system prompt: {_short(repr(env.system_prompt)) if env.system_prompt else 'none'}",
             "rubric: " + ", ".join(f"{n} (weight {w:g})" for n, w in zip(env.rubric.names, env.rubric.weights))]
    for func in env.rubric.funcs:  # a verifiers environment's one function: its rubric's own weights
        if isinstance(vf := getattr(func, "verifiers_weights", None), dict):
            lines.append(f"verifiers rubric: weighted sum of {', '.join(f'{n} (weight {w:g})' for n, w in vf.items())}"
                         f"; weights add to {sum(vf.values()):g}")
    if env.multi_turn:
        tools = [f"{s['function']['name']}({', '.join((s['function'].get('parameters') or {}).get('properties', {}))})"
                 for s in env.tool_schemas()]
        lines += [f"multi-turn: yes, max_turns {env.max_turns}, tool parser {env.tool_parser}, env_response "
                  f"{'yes' if env.env_response else 'no'}",
                  f"tools: {', '.join(tools) if tools else 'none'}"]
    else:
        lines.append("multi-turn: no (one assistant turn, no tools)")
    hooks = [h for h in ("setup", "cleanup") if getattr(env, h) is not None]
    lines.append(f"hooks: {', '.join(hooks) if hooks else 'none'}")
    if (ws := env.packed_workspace()) is not None:
        lines.append(f"workspace: {ws.path} ({ws.files} files, {len(ws.archive) / 2**20:.1f} MiB packed, "
                     f"sha256 {ws.digest[:12]})")
    for line in lines:
        console.print(escape(line))
    console.print(escape(f"sample prompt (task {task['task_id']}):"))
    for m in task["prompt"]:
        console.print(escape(f"  {m['role']}: {_short(m['content'])}"))


def _score(env, task: dict, completion: str) -> None:
    """Score ``completion`` against ``task`` with the rubric as the verifier scores a single-turn rollout, and
    print the score, each function's reward and the metrics.

    Raises:
        typer.Exit: (2) the rubric refused it (a reward raised, returned no number, or the score is outside [0, 1]).
    """
    from shared.envs import RewardError
    from shared.verifier_specs import EnvironmentSpec

    spec = EnvironmentSpec.model_validate(task["verifier"])
    context = orjson.loads(orjson.dumps({  # what the verifier sends its reward workers, JSON and all
        "prompt": task["prompt"], "completion": completion, "answer": spec.answer, "info": spec.info, "state": {},
        "tool_calls": [], "turns": [], "task": spec.task}))
    try:
        result = env.rubric.score(**context)
    except RewardError as e:
        raise _fail(f"scoring --score against task {task['task_id']}: {e}") from None
    console.print(escape(f"score of --score against task {task['task_id']}: {result.score:.4g}"
                         + (" (single-turn: state {}, no tool calls, no turns)" if env.multi_turn else "")))
    console.print(escape("rewards: " + ", ".join(f"{n} {'None' if v is None else f'{v:.4g}'}"
                                                 for n, v in result.rewards.items())))
    console.print(escape("metrics: " + (", ".join(f"{n} {v:.4g}" for n, v in result.metrics.items()) or "none")))


@env_app.command("check")
def check_cmd(
    id_: Annotated[Optional[str], typer.Option(
        "--id", help="An installed environment's entry point (group flywheel.environments).")] = None,
    module: Annotated[Optional[str], typer.Option(
        help="A module on the Python path, pkg.mod or pkg.mod:function.")] = None,
    path: Annotated[Optional[str], typer.Option(
        help="A Python file, envs/my_env.py or envs/my_env.py:function.")] = None,
    args: Annotated[Optional[str], typer.Option(
        help="The loading function's keyword arguments, a JSON object.")] = None,
    rows: Annotated[Optional[int], typer.Option(
        min=1, help="Read at most this many rows of each dataset (default: all, as a run reads them).")] = None,
    score: Annotated[Optional[str], typer.Option(
        help="Score this completion against the first row with the rubric and print the score, each reward and "
             "the metrics.")] = None,
) -> None:
    """Load an environment (exactly one of --id, --module, --path) as the services do, make its rows the tasks a
    run would make, and print a summary (rows, columns, system prompt, rubric, tools, a sample prompt); with
    --score, score one completion. Exit 2 with one line naming the module, file, attribute or column when the
    environment cannot be loaded or a row is unusable."""
    from shared.envs import load_environment, load_rows
    from shared.envs.tasks import environment_name

    ref = _reference(id_, module, path, args)
    try:
        env = load_environment(ref)
    except ValueError as e:  # EnvironmentLoadError: names the reference, module, file or attribute
        raise _fail(str(e)) from None
    domain = environment_name(ref, env.name)
    try:
        train = load_rows(env.dataset, env.columns, limit=rows)
        held = None if env.eval_dataset is None else load_rows(env.eval_dataset, env.columns, "test", rows)
    except ValueError as e:  # DatasetError: names the row, the column and the columns the row has
        raise _fail(f"environment {ref.label()}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's dataset object: whatever fails, say so in one line
        raise _fail(f"environment {ref.label()}: its dataset cannot be read: {type(e).__name__}: {e}") from None
    if not train:
        raise _fail(f"environment {ref.label()}: its dataset has no rows")
    tasks = _tasks(ref, env, train, "train", domain)
    _tasks(ref, env, held or [], "eval", domain)
    _summary(ref, env, domain, train, tasks[0], held, rows)
    if score is not None:
        _score(env, tasks[0], score)
