"""``flywheel run`` and ``flywheel job``: the main job, on a local system it starts (``run``) or on one run
elsewhere (``job``, :class:`RemoteSystem`): submit the config's tasks, follow training to
``budget.max_steps``, evaluate the held-out split at the final version, and write the run report."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.cli.client import SchedulerApi, _token_for, submit_tasks
from flywheel.cli.common import ConfigArg, RetryOpt, RunDirOpt, SetOpt, _load, _local_run_dir, _read_jsonl, console
from flywheel.cli.system import _interrupt, _start, _stop
from flywheel.launcher import LocalSystem
from flywheel.report import write_report
from flywheel.tasks import make_tasks
from shared.client import ApiError


def run(
    config: ConfigArg,
    report: Annotated[Optional[Path], typer.Option(help="Write a JSON report here (and a PNG plot beside it).")] = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    submit: Annotated[Optional[Path], typer.Option(help="Also submit this JSONL task file.")] = None,
    retry: RetryOpt = 120.0,
) -> None:
    """Train end to end: start everything, submit the config's tasks, train, evaluate before/after, stop.
    A crashed service (the scheduler included) is restarted by the supervisor and the job goes on."""
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the services too, not only Ctrl-C
    t0 = time.monotonic()
    extra = _read_jsonl(submit) if submit else []
    loaded = _load(config, set_)[0]
    if loaded.stages == ["sft"]:
        from flywheel.cli.sft import run_sft_stage

        run_sft_stage(config, loaded)
        return
    tasks = config_tasks(loaded) + extra  # before anything starts
    check_environment_domains(loaded)
    if "sft" in loaded.stages:  # [sft, rl]: the tasks and domains checked first, then SFT, then RL from its model
        from flywheel.cli.sft import run_sft_stage

        sft_model = run_sft_stage(config, loaded)
        console.print(f"rl stage: model.name = {sft_model} (the SFT model: the base and the KL reference)",
                      markup=False, highlight=False)
        set_ = [*(set_ or []), f"model.name={sft_model}"]
        t0 = time.monotonic()  # --timeout and the report's wall time are the RL stage's
    system, cfg = _start(config, set_, run_dir, fresh=True)
    try:
        result = _train(system, cfg, t0, timeout, tasks, retry_s=retry, report=report)
    except (httpx.HTTPError, RunStalled, TimeoutError) as e:
        raise _stopped(e) from None
    finally:
        _stop(system)
    _summarise(result, report)


def job(
    config: ConfigArg,
    url: Annotated[str, typer.Option(help="The running scheduler's URL, e.g. http://scheduler:8000.")],
    report: Annotated[Optional[Path], typer.Option(help="Write a JSON report here (and a PNG plot beside it).")] = None,
    set_: SetOpt = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 7200.0,
    wait: Annotated[float, typer.Option(help="Seconds to wait for the scheduler to answer /healthz.")] = 900.0,
    retry: RetryOpt = 300.0,
    run_dir: Annotated[Optional[Path], typer.Option(
        help="The system's run directory, where its token is (<run dir>/auth_token); default: the local "
             "system's when it serves --url, else the config's run.dir. $FLYWHEEL_AUTH__TOKEN wins.")] = None,
) -> None:
    """The main job against a system that is already running (docker-compose): wait for the scheduler, submit
    the config's tasks, follow training to ``budget.max_steps``, evaluate the held-out split, write the report.
    Starts and stops nothing. Sends the system's token; rides through a scheduler restart for ``--retry`` s."""
    logging.basicConfig(level=logging.WARNING)
    cfg, _ = _load(config, set_)
    tasks = config_tasks(cfg)
    with console.status(f"waiting for the scheduler at {url}"):
        wait_for_scheduler(url, wait)
    t0 = time.monotonic()
    try:
        where = run_dir or _local_run_dir(url) or Path(os.path.expanduser(cfg.run.dir))
        result = _train(RemoteSystem(url.rstrip("/"), where), cfg, t0, timeout, tasks, retry_s=retry)
    except (httpx.HTTPError, RunStalled, TimeoutError) as e:
        raise _stopped(e) from None
    _summarise(result, report)


def _stopped(e: Exception) -> typer.Exit:
    """Say why the job stopped and give the exit (1) to raise: a stalled run, the ``--timeout`` reached (the
    report, when asked for, holds what the run reached), or the scheduler unreachable or answering an error
    (shared.client's ApiError names the URL, attempts and last error; other HTTP errors are named by type)."""
    why = e if isinstance(e, (ApiError, RunStalled)) else f"{type(e).__name__}: {e}"
    if isinstance(e, TimeoutError):
        why = f"{why} (--timeout; the report, with --report, holds the steps reached and the alerts raised)"
    console.print(f"[red]the job stopped: {why}[/]")
    return typer.Exit(1)


class RunStalled(RuntimeError):
    """The scheduler reports that the run cannot go on (``GET /v1/status`` ``stalled``); the message says why."""


@dataclass
class RemoteSystem:
    """A system run by someone else (docker-compose, a cluster): the scheduler's URL, nothing to supervise.
    Stands in for :class:`LocalSystem` in the job's phases (:func:`_train`)."""

    scheduler_url: str
    run_dir: Path
    precision: dict = field(default_factory=dict)
    """Unknown from here (the services decide on their own machines and log it): ``{}``."""

    def check(self) -> list[str]:
        """Nothing to supervise here: the orchestrator restarts the services."""
        return []

    def sample_rss(self) -> dict[str, int]:
        """Peak RSS per service is not visible from here (the processes run elsewhere): ``{}``."""
        return {}

    @property
    def cpu_seconds(self) -> dict[str, float]:
        """CPU time per service is not visible from here either: ``{}``."""
        return {}


def wait_for_scheduler(url: str, timeout_s: float) -> None:
    """Poll ``GET {url}/healthz`` with backoff (0.5 s doubling to 5 s) until it answers 200.

    Raises:
        TimeoutError: no healthy answer within ``timeout_s`` seconds.
    """
    deadline, pause = time.monotonic() + timeout_s, 0.5
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler at {url} was not healthy within {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(5.0, pause * 2)


def config_tasks(cfg) -> list[dict]:
    """The config's tasks (:func:`flywheel.tasks.make_tasks`), made before anything starts: a user environment that
    cannot be imported or built, or a dataset that cannot be read, stops the command here (exit 2) with an error
    naming the reference, module, file or column."""
    try:
        return make_tasks(cfg.tasks)
    except ValueError as e:  # EnvironmentLoadError and DatasetError included
        console.print(f"[red]the tasks cannot be made: {e}[/]")
        raise typer.Exit(2) from None


def check_environment_domains(cfg) -> None:
    """Load every ``domains.<name>.environment`` as the scheduler will (:func:`scheduler_service.generate.
    check_environment`), before anything starts: one that cannot be imported or built, a dataset that cannot be
    read or lacks a column, or a relative ``path`` (the scheduler runs in the run directory, where it would name
    another file) stops the command here (exit 2), naming the domain, the field and the module, file or column."""
    from scheduler_service.generate import check_environment

    problems = []
    for name, dom in cfg.domains.items():
        ref = dom.environment
        if ref is not None and ref.path and not Path(ref.path.split(":")[0]).expanduser().is_absolute():
            problems.append(f"domains.{name}.environment.path {ref.path!r} is relative: the scheduler runs in the "
                            "run directory, so give an absolute path (or a module or an installed id)")
            continue
        problems += [f"domains.{name}.{'.'.join(map(str, loc))}: {msg}" for loc, msg in check_environment(name, dom)]
    if problems:
        for p in problems:
            console.print(f"[red]the domains cannot be made: {p}[/]")
        raise typer.Exit(2)


def _train(system: LocalSystem, cfg, t0: float, timeout_s: float, tasks: list[dict] = (),
           retry_s: float = 120.0, report: Path | None = None) -> dict:
    """The main job's phases: submit the tasks, follow training to ``budget.max_steps``, evaluate the
    held-out split at the final version, and gather the report (:func:`_report`). Every request to the
    scheduler sends the system's token and rides through a scheduler restart (:class:`SchedulerApi`).

    Raises:
        TimeoutError: training or the final evaluation did not finish by ``t0 + timeout_s``.
        shared.client.ApiError: the scheduler refused the tasks, or stayed unreachable for ``retry_s`` seconds.
        RuntimeError: the supervisor gave up on a service (``LocalSystem.check``).
    """
    api = SchedulerApi(system, _token_for(system.run_dir, cfg), retry_s)
    try:
        submit_tasks(api.client, list(tasks))
        deadline = t0 + timeout_s
        try:
            eval_rows = _follow_training(system, api, cfg.budget.max_steps, deadline)
        except (KeyboardInterrupt, TimeoutError, RunStalled) as e:
            if report is not None:  # what the run reached, before the services stop
                _write_partial_report(system, api, cfg, t0, report, f"{type(e).__name__}: {e}")
            raise
        before = next((e for e in sorted(eval_rows.values(), key=lambda e: e["eval_round"])
                       if e["min_policy_version"] == 0), None)
        after = None
        held_out = api.get("/v1/status")["tasks"].get("eval", 0)
        if held_out:  # submitted, or made by the generator domains (``domains.<d>.eval_size``)
            after = _final_eval(system, api, cfg.budget.max_steps, deadline)
        return _report(system, api, cfg, t0, before, after)
    finally:
        api.close()


def _follow_training(system: LocalSystem, api: SchedulerApi, max_steps: int, deadline: float) -> dict[int, dict]:
    """Poll ``GET /v1/status`` every second with a progress bar until the policy version reaches
    ``max_steps``; returns the eval rounds seen done, by round id. A scheduler restart is ridden through
    (:class:`SchedulerApi`).

    Raises:
        TimeoutError: not there by ``deadline`` (``time.monotonic()`` seconds).
    """
    eval_rows: dict[int, dict] = {}
    cols = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn()]
    # not a terminal (CI, nohup, a log file): a live bar shows nothing until the end, so one line per new step
    lines = not console.is_terminal
    t0, shown = time.monotonic(), -1
    with Progress(*cols, console=console, transient=False, disable=lines) as progress:
        bar = progress.add_task("steps", total=max_steps, info="waiting for the first eval and the first batch")
        while True:
            for note in system.check():
                progress.console.print(f"[yellow]{note}[/]")
            st = api.get("/v1/status")
            for ev in st.get("evals", []):
                if ev.get("done") and ev["eval_round"] not in eval_rows:
                    eval_rows[ev["eval_round"]] = ev
                    progress.console.print(f"eval round {ev['eval_round']} at policy version "
                                           f"{ev.get('policy_versions')}: accuracy {_fmt(ev)}")
            step = min(st["policy_version"], max_steps)
            progress.update(bar, completed=step, info=_status_line(st, eval_rows))
            if lines and step != shown:
                shown = step
                progress.console.print(f"step {step}/{max_steps} {_status_line(st, eval_rows)} "
                                       f"{time.monotonic() - t0:.0f} s", soft_wrap=True)
            if st["policy_version"] >= max_steps:
                return eval_rows
            if st.get("stalled"):  # the scheduler says the run cannot go on (scheduler_service/stall.py)
                raise RunStalled(st["stalled"]["message"])
            if time.monotonic() > deadline:
                raise TimeoutError(f"training did not reach {max_steps} steps by the deadline")
            time.sleep(1.0)  # also the supervision period (system.check above)


def _status_line(st: dict, eval_rows: dict[int, dict]) -> str:
    """One line of the progress bar from a ``GET /v1/status`` reply; open breakers and critical alerts are named
    at its end (a run whose breaker is open waits for its probe: the line says so)."""
    tr = st.get("trainer") or {}
    last_eval = max(eval_rows.values(), key=lambda e: e["eval_round"])["accuracy"] if eval_rows else None
    dropped = sum((st.get("dropped_groups") or {}).values())
    guard = "".join(f" breaker {d} {b}" for d, b in sorted((st.get("breakers") or {}).items()))
    critical = (st.get("alerts") or {}).get("critical", 0)
    guard += f" critical alerts {critical} (flywheel alerts)" if critical else ""
    return (f"v{st['policy_version']} reward {tr.get('train/reward_mean', float('nan')):.2f} "
            f"pass {st.get('train_reward_mean') or 0:.2f} stale {st['staleness']['mean'] or 0:.2f} "
            f"eval {'-' if last_eval is None else f'{last_eval:.2f}'} in-flight {st['in_flight_groups']} "
            f"dropped {dropped} "
            f"kl {tr.get('loss/kl_behaviour', 0.0):.3f} ent {tr.get('loss/entropy', 0.0):.2f} "
            f"clip {tr.get('loss/clip_frac', 0.0):.2f} gnorm {tr.get('train/grad_norm', 0.0):.1f}{guard}")


def _final_eval(system: LocalSystem, api: SchedulerApi, max_steps: int, deadline: float) -> dict:
    """The held-out round at policy version ``max_steps``: one the scheduler already started
    (``scheduler.eval_every``), else a new one; waits for it (at least 60 s). The ``POST /v1/evals`` is
    retried only when it surely did not reach the scheduler (it makes a new round each time)."""
    rounds = api.get("/v1/evals")
    rid = next((e["eval_round"] for e in rounds if e["min_policy_version"] >= max_steps), None)
    if rid is None:
        rid = api.post("/v1/evals", {"min_policy_version": max_steps})["eval_round"]
    with console.status(f"final held-out evaluation at policy version {max_steps}"):
        return _wait_eval(system, api, rid, max(60.0, deadline - time.monotonic()))


def _wait_eval(system: LocalSystem, api: SchedulerApi, round_id: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        for note in system.check():
            console.print(f"[yellow]{note}[/]")
        ev = api.get(f"/v1/evals/{round_id}")
        if ev.get("done"):
            return ev
        if time.monotonic() > deadline:
            raise TimeoutError(f"eval round {round_id} not done after {timeout_s:.0f} s: {ev}")
        time.sleep(1.0)


def _report(system: LocalSystem, api: SchedulerApi, cfg, t0: float, before: dict | None,
            after: dict | None, settle_s: float = 30.0) -> dict:
    """The run report (``--report``): title, evals before/after, per-step metrics history, config. Waits up to
    ``settle_s`` for the last step's metrics record."""
    max_steps = cfg.budget.max_steps
    history = api.get("/v1/metrics/history")
    # the last step's metrics record may trail its weight announcement (it follows the optimizer state)
    settle = time.monotonic() + settle_s
    while max((h["step"] for h in history), default=0) < max_steps and time.monotonic() < settle:
        time.sleep(0.5)
        history = api.get("/v1/metrics/history")
    evals = api.get("/v1/evals")
    status = api.get("/v1/status")
    wall = time.monotonic() - t0

    def ev(e):
        return None if e is None else {"accuracy": e["accuracy"], "n": e["n"],
                                        "policy_version": max(e.get("policy_versions") or [0])}

    return {
        "title": f"{cfg.tasks.dataset if cfg.tasks.kind == 'reasoning_gym' else cfg.tasks.kind}: "
                 f"{cfg.budget.batch_groups} groups x {cfg.tasks.samples_per_task} samples, eta={cfg.budget.max_staleness}",
        "eval": {"before": ev(before), "after": ev(after)},
        "steps": max((h["step"] for h in history), default=0),
        "dropped_groups": status.get("dropped_groups", {}),
        # what the run generated per split (samples, generated_tokens, ...): what `flywheel budget` estimates
        "cost": status.get("cost"),
        "wall_seconds": wall,
        # bytes, VmHWM of each process (the highest over its restarts; the sandbox without its workers)
        "peak_rss_bytes": system.sample_rss(),
        # user + system CPU seconds of each process over the run (summed over its restarts; sampled with the RSS)
        "cpu_seconds": system.cpu_seconds,
        "alerts": alert_summary(api.get("/v1/alerts", params={"limit": 10_000})),
        "history": [{"step": h["step"], "policy_version": h["policy_version"],
                     "mean_reward": h["values"].get("train/reward_mean"), "time": h["time"], **h["values"]}
                    for h in history],
        "evals": [{"eval_round": e["eval_round"], "accuracy": e["accuracy"], "n": e["n"],
                   "policy_version": max(e.get("policy_versions") or [0]),
                   "min_policy_version": e.get("min_policy_version"), "policy_versions": e.get("policy_versions")}
                  for e in evals if e.get("done")],
        "config": cfg.model_dump(mode="json"),
        # the dtype each torch service chose and why (``auto``: bf16 only where the CPU or GPU runs it natively)
        "precision": system.precision,
        "run_dir": str(system.run_dir),
    }


def alert_summary(alerts: dict) -> dict:
    """The run report's ``alerts``: how many alerts fired per severity, each ``<key>:<severity>`` that fired
    with its count, and the keys still firing (from ``GET /v1/alerts``)."""
    fired = [a for a in alerts["recent"] if a["status"] == "firing"]
    counts: dict[str, int] = {}
    for a in fired:
        counts[f"{a['key']}:{a['severity']}"] = counts.get(f"{a['key']}:{a['severity']}", 0) + 1
    return {sev: sum(a["severity"] == sev for a in fired) for sev in ("critical", "warning", "info")} | {
        "fired": counts, "active": [a["key"] for a in alerts["active"]]}


def _summarise(result: dict, report: Path | None) -> None:
    """Print the job's held-out accuracy before and after; write the JSON report and its plot when asked."""
    before, after = result["eval"]["before"], result["eval"]["after"]
    console.print(f"held-out greedy accuracy: {_fmt(before)} -> {_fmt(after)} in {result['steps']} steps, "
                  f"{result['wall_seconds']:.0f} s")
    rss = result.get("peak_rss_bytes") or {}
    if rss:
        console.print("peak RSS: " + ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in sorted(rss.items())))
    cpu = result.get("cpu_seconds") or {}
    if cpu:
        console.print("CPU seconds: " + ", ".join(f"{n} {c:.0f}" for n, c in sorted(cpu.items())))
    if report:
        png = write_report(report, result)
        console.print(f"report: {report} (plot {png})")


def _fmt(ev: dict | None) -> str:
    return "n/a" if not ev or ev.get("accuracy") is None else f"{ev['accuracy']:.3f} (n={ev['n']})"


def _write_partial_report(system: LocalSystem, api: SchedulerApi, cfg, t0: float, report: Path, why: str) -> None:
    """Write the run report of a run that stops before ``max_steps`` (interrupted, or past its timeout): the
    steps and eval rounds it reached, with ``interrupted`` saying why. Best effort: a scheduler that does not
    answer leaves no report (said on the console)."""
    try:
        before = next((e for e in api.get("/v1/evals") if e.get("done") and e.get("min_policy_version") == 0), None)
        result = _report(system, api, cfg, t0, before, None, settle_s=0.0) | {"interrupted": why}
        console.print(f"[yellow]stopped early ({why}): the report has the {result['steps']} steps reached[/]")
        _summarise(result, report)
    except Exception as e:  # noqa: BLE001 - best effort: the interrupt itself is what the caller re-raises
        console.print(f"[red]no report for the interrupted run: {type(e).__name__}: {e}[/]")
