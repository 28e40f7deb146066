"""The CLI's access to the scheduler: where the system's token comes from (:func:`_token_for`), a client
that retries through a scheduler restart (:func:`scheduler_client`, :class:`SchedulerApi` for the job, which
supervises the system between attempts), posting tasks (:func:`submit_tasks`) and one-shot requests
(:func:`_call`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import typer

from flywheel.cli.common import COMMAND_RETRY_S, _local_run_dir, _state, console
from flywheel.launcher import LocalSystem
from shared.auth import token_from_run_dir
from shared.client import (SCHEDULER_IDEMPOTENT_POSTS, ApiClient, ApiError, ApiUnreachable, RetryEvent, RetryPolicy,
                           Token)


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


def _target(url: str | None, run_dir: Path | None) -> tuple[str, Token]:
    """The scheduler's URL and where its token comes from: ``--url`` (token from the environment, else
    ``--run-dir``'s file, else the local system's when it is at that URL), else the running system's
    (``<run dir>/flywheel.json``, its ``auth_token``)."""
    if url is not None:
        return url.rstrip("/"), _token_for(run_dir or _local_run_dir(url))
    st = _state(run_dir)
    return st["scheduler_url"], _token_for(st.get("run_dir") or run_dir)


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
