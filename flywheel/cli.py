"""``flywheel``: run a training job end to end, or start, feed, inspect and stop a local system.

    flywheel run examples/arithmetic.yaml --report runs/arithmetic.json
    flywheel up examples/arithmetic.yaml        # serve until Ctrl-C or `flywheel down`
    flywheel job examples/arithmetic.yaml --url http://scheduler:8000   # the job on a system run elsewhere (compose)
    flywheel submit tasks.jsonl                 # one task object per line (format in docs/guide.md)
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
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import httpx
import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.config import load_config
from flywheel.clean import clean_cmd
from flywheel.launcher import LocalSystem, overrides_to_env
from flywheel.report import write_report
from flywheel.tasks import make_tasks
from shared.auth import token_from_run_dir
from shared.client import (SCHEDULER_IDEMPOTENT_POSTS, ApiClient, ApiError, ApiUnreachable, RetryEvent, RetryPolicy,
                           Token)
from shared.config import ModelConfig
from shared.model import SMOLLM2, resolve_model_dir

app = typer.Typer(add_completion=False, help="Flywheel: asynchronous RL post-training over Kafka.")
console = Console(soft_wrap=True)  # no hard wrapping of log lines when not on a terminal
log = logging.getLogger("flywheel")

ConfigArg = Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="System config (YAML).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override, e.g. budget.max_steps=5 (repeatable).")]
RunDirOpt = Annotated[Optional[Path], typer.Option(help="Run directory (default: the config's run.dir).")]
RetryOpt = Annotated[float, typer.Option(
    min=0.0, help="Seconds the CLI keeps retrying an unreachable scheduler (a restart) before it gives up.")]

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


def _start(config: Path, sets: list[str] | None, run_dir: Path | None, fresh: bool) -> tuple[LocalSystem, object]:
    cfg, env = _load(config, sets)
    base = Path(os.path.expanduser(cfg.run.dir))
    if run_dir is None:
        run_dir = base / (f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}" if fresh else "system")
    with console.status("preparing the model (converted once, then cached)"):
        resolve_model_dir(cfg.model.name, cfg.model.cache_dir)
    with console.status("starting the broker and five services"):
        system = LocalSystem.start(config, run_dir, env)
    _pointer().parent.mkdir(parents=True, exist_ok=True)
    _pointer().write_bytes((system.run_dir / "flywheel.json").read_bytes())
    console.print(f"[green]system up[/]: scheduler {system.scheduler_url} (docs at /docs, dashboard at "
                  f"{system.scheduler_url}/dashboard), "
                  f"broker {system.env['FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS']}, run dir {system.run_dir}")
    if system.precision:
        console.print("precision: " + ", ".join(f"{k} {p['dtype']}" for k, p in system.precision.items())
                      + f" ({next(iter(system.precision.values()))['hardware']})")
    return system, cfg


def scheduler_client(url: str, token: Token, retry_s: float = COMMAND_RETRY_S,
                     on_retry=None) -> ApiClient:
    """A client of the scheduler at ``url`` that sends ``token`` and retries through a restart for up to
    ``retry_s`` seconds per call (``POST /v1/tasks`` included: it is idempotent, see shared/client.py).
    Pauses stay under 1 s: ``on_retry`` supervises the system (``LocalSystem.check``) between attempts,
    and the launcher wants that at least every second."""
    return ApiClient(url, token, timeout=10.0, on_retry=on_retry,
                     retry=RetryPolicy(deadline_s=retry_s, max_backoff_s=1.0,
                                       idempotent_posts=SCHEDULER_IDEMPOTENT_POSTS))


def submit_tasks(api: ApiClient | str, tasks: list[dict], batch: int = 1000, token: Token = None) -> list[str]:
    """POST tasks to the scheduler in batches; returns their ids. ``api``: a client, or the scheduler's URL
    (then ``token``, else the environment's token, is sent). A batch is retried through a restart: the
    registry stores a batch posted twice once (``POST /v1/tasks`` is idempotent).

    Raises:
        shared.client.ApiStatusError: the scheduler refused a batch (the message holds its reply; 401:
            :class:`shared.client.Unauthorized`, saying where the token comes from).
        shared.client.ApiUnreachable: no answer within the client's retry deadline.
    """
    own = isinstance(api, str)
    client = scheduler_client(api, token or token_from_run_dir(None), retry_s=300.0) if own else api
    try:
        ids: list[str] = []
        for i in range(0, len(tasks), batch):
            ids.extend(client.post("/v1/tasks", {"tasks": tasks[i:i + batch]}, timeout=120)["task_ids"])
        return ids
    finally:
        if own:
            client.close()


def _token_for(run_dir: str | os.PathLike | None, cfg=None) -> Token:
    """Where the CLI finds the system's token, read at each request (the launcher may write the file after
    the client is made), first found wins: ``auth.token`` of the config, ``$FLYWHEEL_AUTH__TOKEN``, the run
    dir's own files (``<run_dir>/auth_token``, which the launcher writes, then the config's
    ``auth.token_file`` there), ``$FLYWHEEL_AUTH__TOKEN_FILE``. The run dir comes before the environment's
    file: it names this system, the variable may have been set for another."""
    def token() -> str | None:
        if cfg is not None and cfg.auth.token:
            return cfg.auth.token
        if os.environ.get("FLYWHEEL_AUTH__TOKEN"):
            return os.environ["FLYWHEEL_AUTH__TOKEN"]
        if run_dir is not None:
            names = ["auth_token"] + ([os.path.expanduser(cfg.auth.token_file)] if cfg is not None else [])
            for name in names:
                try:
                    if text := (Path(run_dir) / name).read_text().strip():
                        return text
                except OSError:
                    pass
        return token_from_run_dir(None)
    return token


class SchedulerApi:
    """The job's client of the scheduler (:func:`_train`): every call retries through a scheduler restart
    for up to ``retry_s`` seconds while supervising ``system`` (``system.check()`` restarts the dead
    scheduler, and raises when the supervisor gives up). Says once per outage that the scheduler is
    unreachable, and when it answers again."""

    def __init__(self, system, token: Token, retry_s: float) -> None:
        self.system, self.retry_s = system, retry_s
        self.client = scheduler_client(system.scheduler_url, token, retry_s, on_retry=self._on_retry)
        self.down_since: float | None = None

    def _on_retry(self, ev: RetryEvent) -> None:
        for note in self.system.check():
            console.print(f"[yellow]{note}[/]")
        if self.down_since is None:
            self.down_since = time.monotonic() - ev.elapsed_s
            who = "restarted by the supervisor" if isinstance(self.system, LocalSystem) else \
                "waiting for its orchestrator to restart it"
            console.print(f"[yellow]scheduler unreachable ({ev.error}), retrying for up to {self.retry_s:.0f} s "
                          f"({who})[/]")

    def _answered(self) -> None:
        if self.down_since is not None:
            console.print(f"[green]scheduler answering again after {time.monotonic() - self.down_since:.1f} s[/]")
            self.down_since = None

    def get(self, path: str, **kw):
        out = self.client.get(path, **kw)
        self._answered()
        return out

    def post(self, path: str, json=None, **kw):
        out = self.client.post(path, json, **kw)
        self._answered()
        return out

    def close(self) -> None:
        self.client.close()


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


@app.command()
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
    system, cfg = _start(config, set_, run_dir, fresh=True)
    try:
        result = _train(system, cfg, t0, timeout, extra, retry_s=retry, report=report)
    except httpx.HTTPError as e:  # shared.client's ApiError included: it names the URL, attempts, last error
        console.print(f"[red]the job stopped: {e if isinstance(e, ApiError) else f'{type(e).__name__}: {e}'}[/]")
        raise typer.Exit(1) from None
    except RunStalled as e:
        console.print(f"[red]the job stopped: {e}[/]")
        raise typer.Exit(1) from None
    finally:
        _stop(system)
    _summarise(result, report)


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


class RunStalled(RuntimeError):
    """The scheduler reports that the run cannot go on (``GET /v1/status`` ``stalled``); the message says why."""


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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


def _train(system: LocalSystem, cfg, t0: float, timeout_s: float, extra: list[dict] = (),
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
        tasks = make_tasks(cfg.tasks) + list(extra)
        submit_tasks(api.client, tasks)
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
                                           f"{ev.get('policy_versions')}: accuracy {ev['accuracy']:.3f} (n={ev['n']})")
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
    """One line of the progress bar from a ``GET /v1/status`` reply."""
    tr = st.get("trainer") or {}
    last_eval = max(eval_rows.values(), key=lambda e: e["eval_round"])["accuracy"] if eval_rows else None
    dropped = sum((st.get("dropped_groups") or {}).values())
    return (f"v{st['policy_version']} reward {tr.get('train/reward_mean', float('nan')):.2f} "
            f"pass {st.get('train_reward_mean') or 0:.2f} stale {st['staleness']['mean'] or 0:.2f} "
            f"eval {'-' if last_eval is None else f'{last_eval:.2f}'} in-flight {st['in_flight_groups']} "
            f"dropped {dropped} "
            f"kl {tr.get('loss/kl_behaviour', 0.0):.3f} ent {tr.get('loss/entropy', 0.0):.2f} "
            f"clip {tr.get('loss/clip_frac', 0.0):.2f} gnorm {tr.get('train/grad_norm', 0.0):.1f}")


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


def alert_summary(alerts: dict) -> dict:
    """The run report's ``alerts``: how many alerts fired per severity, each ``<key>:<severity>`` that fired
    with its count, and the keys still firing (from ``GET /v1/alerts``)."""
    fired = [a for a in alerts["recent"] if a["status"] == "firing"]
    counts: dict[str, int] = {}
    for a in fired:
        counts[f"{a['key']}:{a['severity']}"] = counts.get(f"{a['key']}:{a['severity']}", 0) + 1
    return {sev: sum(a["severity"] == sev for a in fired) for sev in ("critical", "warning", "info")} | {
        "fired": counts, "active": [a["key"] for a in alerts["active"]]}


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


@app.command()
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


@app.command()
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
    with console.status(f"waiting for the scheduler at {url}"):
        wait_for_scheduler(url, wait)
    t0 = time.monotonic()
    try:
        where = run_dir or _local_run_dir(url) or Path(os.path.expanduser(cfg.run.dir))
        result = _train(RemoteSystem(url.rstrip("/"), where), cfg, t0, timeout, retry_s=retry)
    except httpx.HTTPError as e:  # shared.client's ApiError included: it names the URL, attempts, last error
        console.print(f"[red]the job stopped: {e if isinstance(e, ApiError) else f'{type(e).__name__}: {e}'}[/]")
        raise typer.Exit(1) from None
    except RunStalled as e:
        console.print(f"[red]the job stopped: {e}[/]")
        raise typer.Exit(1) from None
    _summarise(result, report)


def _stop(system: LocalSystem) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the teardown short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with console.status("stopping"):
        system.stop()


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


def _target(url: str | None, run_dir: Path | None) -> tuple[str, Token]:
    """The scheduler's URL and where its token comes from: ``--url`` (token from the environment, else
    ``--run-dir``'s file, else the local system's when it is at that URL), else the running system's
    (``<run dir>/flywheel.json``, its ``auth_token``)."""
    if url is not None:
        return url.rstrip("/"), _token_for(run_dir or _local_run_dir(url))
    st = _state(run_dir)
    return st["scheduler_url"], _token_for(st.get("run_dir") or run_dir)


@app.command("submit")
def submit_cmd(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL: one task per line.")],
               url: Annotated[Optional[str], typer.Option(help="Scheduler URL (default: the running system's).")] = None,
               run_dir: RunDirOpt = None, retry: RetryOpt = 120.0) -> None:
    """Post tasks from a JSONL file to a running system (with its token; retried through a restart)."""
    url, token = _target(url, run_dir)
    try:
        with scheduler_client(url, token, retry_s=retry) as api:
            ids = submit_tasks(api, _read_jsonl(file))
    except ApiError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    console.print(f"submitted {len(ids)} tasks")


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


@app.command()
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


@app.command()
def status(run_dir: RunDirOpt = None, retry: RetryOpt = 5.0) -> None:
    """Show the running system's processes and the scheduler's status."""
    st = _state(run_dir)
    for name, pid in {"supervisor": st["supervisor_pid"], "broker": st["broker_pid"], **st["services"]}.items():
        console.print(f"{name:<11} pid {pid}: {'[green]running[/]' if _alive(pid) else '[red]gone[/]'}")
    console.print(f"dashboard   {st['scheduler_url']}/dashboard")
    out = _call("GET", st["scheduler_url"], _token_for(st.get("run_dir")), "/v1/status", retry_s=retry)
    console.print_json(orjson.dumps(out).decode())


@app.command("domains")
def domains_cmd(run_dir: RunDirOpt = None,
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
    console.print(table)


UrlOpt = Annotated[Optional[str], typer.Option(help="Scheduler URL (default: the running system's).")]


def _call(method: str, url: str, token: Token, path: str, retry_s: float = COMMAND_RETRY_S, **kw):
    """One request to the scheduler with the token, retried through a restart for ``retry_s`` seconds
    (shared/client.py says which requests may be retried); unreachable, or a 4xx/5xx reply: a red message
    (the server's, field by field for a 422; where the token comes from for a 401) and exit 1."""
    try:
        with scheduler_client(url, token, retry_s) as api:
            return api.request(method, path, timeout=30, **kw).json()
    except ApiUnreachable as e:
        console.print(f"[red]scheduler unreachable: {e}[/]")
        raise typer.Exit(1) from None
    except ApiError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    except httpx.HTTPError as e:
        console.print(f"[red]{method} {url}{path}: scheduler unreachable: {type(e).__name__}: {e}[/]")
        raise typer.Exit(1) from None


def _alert_rows(reply: dict, active_only: bool) -> list[tuple[bool, dict]]:
    """``(active, alert)`` rows of a ``GET /v1/alerts`` reply: the active alerts first, then the recent
    records that are not one of them (newest first)."""
    active = reply["active"]
    seen = {(a["key"], a["time"], a["status"]) for a in active}
    rows = [(True, a) for a in active]
    if not active_only:
        rows += [(False, a) for a in reply["recent"] if (a["key"], a["time"], a["status"]) not in seen]
    return rows


@app.command("alerts")
def alerts_cmd(run_dir: RunDirOpt = None, url: UrlOpt = None,
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
    console.print(table)


def _operator_commands() -> list[str]:
    from typing import get_args

    from shared.schemas import ControlCommand

    return [c for c in get_args(ControlCommand) if c != "domain_state"]  # domain_state: the scheduler's own


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


@app.command("control")
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
    run_dir: RunDirOpt = None, url: UrlOpt = None, retry: RetryOpt = COMMAND_RETRY_S,
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


@app.command()
def down(run_dir: RunDirOpt = None, timeout: float = 60.0) -> None:
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


app.command("clean")(clean_cmd)  # flywheel/clean.py: free finished runs' checkpoints


@app.command("tasks")
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


@app.command("budget")
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
    sandbox seconds, judge calls) per domain, train and eval; see flywheel/budget.py."""
    from flywheel import budget

    try:
        cfg = _load(config, set_)[0]
        n = pilot_tasks if pilot_tasks is not None else (0 if history else 16)
        if n < 0:
            raise ValueError("--pilot-tasks must be >= 0")
        hist = budget.history_costs(history) if history else None
        if hist:
            hist["path"] = str(history)
        tasks = budget.all_tasks(cfg, max(n, 1))
        err = Console(stderr=True)
        with err.status(f"pilot: {n} training and {n} held-out tasks with {cfg.model.name}"):
            pilot = budget.run_pilot(cfg, tasks, n, seed=cfg.rollout.seed) if n else None
        report = budget.budget_report(cfg, tasks, pilot, hist, config_name=str(config))
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    if json_:
        typer.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
    else:
        budget.render(report, console)


@app.command("judge-calibrate")
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



# ---------------------------------------------------------------- flywheel analytics (flywheel/analytics.py)

analytics_app = typer.Typer(help="The topics in DuckDB: `flywheel analytics` ingests (incrementally, no "
                                 "duplicates), `flywheel analytics query SQL` asks.")
app.add_typer(analytics_app, name="analytics")
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

    from flywheel import analytics
    from shared.config import KafkaConfig
    from shared.kafka import install_stop_signals

    if bootstrap is None:
        st = _state(run_dir)
        bootstrap, run_dir = st["bootstrap_servers"], run_dir or Path(st["run_dir"])
    store = analytics.Store(_analytics_db(db, run_dir))

    def progress(rep) -> None:
        console.print(f"batch {rep.batches}: {rep.records} records read, rows added {rep.added}")

    async def go():
        stop = asyncio.Event()
        install_stop_signals(stop)
        return await analytics.ingest(store, KafkaConfig(bootstrap_servers=bootstrap), follow=follow, stop=stop,
                                      batch_records=batch_size, on_batch=progress if verbose else None)

    try:
        rep = asyncio.run(go())
        totals = store.counts()
    except (analytics.LogChangedError, duckdb.Error, KafkaError, OSError) as e:
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

    from flywheel import analytics

    try:
        cols, rows = analytics.query(_analytics_db(db, run_dir), sql)
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
    console.print(table)
    console.print(f"{len(rows)} rows")

if __name__ == "__main__":
    app()
