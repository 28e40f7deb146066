"""``flywheel clean``: free the bulk of finished runs (checkpoint weights and optimizer state).

A run directory keeps, per checkpoint store (``run.checkpoint_dir``, see ``shared/checkpoint.py``), the
weights of the newest ``trainer.keep_checkpoints`` versions and the newest one's optimizer state: about
2.2 GB for SmolLM2 with ``keep_checkpoints: 2`` (3.2 GB when every kept version kept its optimizer state). Five finished runs filled a
machine, so this removes, for every run that is not running:

- by default: every version but the newest (and the newest complete one, ``latest.json``, when a crash
  left them apart), weights included, and the kept versions' optimizer state (``optimizer.pt``; a
  ``trainer_state.pt`` of the older layout that holds the optimizer is rewritten without it). The
  newest weights, its counters and ``latest.json`` stay: the policy can still be loaded, evaluated or
  served, and the run restarted at ``max_steps``, but not trained further.
- with ``--all``: the whole checkpoint store.

Reports, logs, the registry and everything else in the run directory are never touched. A run whose
``flywheel.json`` names a live process (the supervisor, the broker or a service) is skipped and said so.
``--dry-run`` lists what would go and the bytes it would free, and deletes nothing.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import orjson
import typer
from rich.console import Console

console = Console(soft_wrap=True)

DEFAULT_ROOTS = (Path(".flywheel"), Path("runs"))
"""Where runs live when no path is given: the default ``run.dir`` and the one the example configs use."""
_VERSION = re.compile(r"^v\d{6}$")
_RUN_MARKERS = ("flywheel.json", "checkpoints", "logs")


@dataclass
class RunPlan:
    """What cleaning one run directory removes (``remove``: paths, ``rewrite``: old-layout trainer states to
    write again without their optimizer), or why it is skipped."""

    run_dir: Path
    skipped: str | None = None
    remove: list[Path] = field(default_factory=list)
    rewrite: list[Path] = field(default_factory=list)
    bytes: int = 0
    """Bytes the plan frees (before it is applied, a rewrite counts its optimizer tensors; after, what it saved)."""


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def live_pids(run_dir: Path) -> list[int]:
    """The live processes ``<run_dir>/flywheel.json`` names (supervisor, broker, services); [] when none.

    An unreadable state file counts as live (``-1``): a system being written is not cleaned."""
    state = run_dir / "flywheel.json"
    if not state.exists():
        return []
    try:
        st = orjson.loads(state.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return [-1]
    pids = [st.get("supervisor_pid"), st.get("broker_pid"), *(st.get("services") or {}).values()]
    return [p for p in pids if _alive(p)]


def run_dirs(paths: list[Path]) -> list[Path]:
    """Each path that is a run directory (holds ``flywheel.json``, ``checkpoints`` or ``logs``), else its
    subdirectories that are; in order, each once."""
    out: list[Path] = []
    for p in paths:
        if not p.is_dir():
            continue
        found = [p] if any((p / m).exists() for m in _RUN_MARKERS) else sorted(
            d for d in p.iterdir() if d.is_dir() and not d.is_symlink() and any((d / m).exists() for m in _RUN_MARKERS))
        out.extend(d for d in found if d.resolve() not in {o.resolve() for o in out})
    return out


def stores(run_dir: Path) -> list[Path]:
    """Checkpoint stores under ``run_dir``: directories holding ``vNNNNNN/update.json`` (at most 3 levels down)."""
    found = set()
    for depth in ("*/update.json", "*/*/update.json", "*/*/*/update.json"):
        for u in run_dir.glob(depth):
            if _VERSION.match(u.parent.name) and not u.is_symlink():
                found.add(u.parent.parent)
    return sorted(found)


def _embedded_optimizer_bytes(state_file: Path) -> int:
    """Bytes of the optimizer tensors inside an old-layout ``trainer_state.pt`` (0 when it holds none)."""
    import torch

    from shared.disk import tensor_bytes

    state = torch.load(state_file, weights_only=False, mmap=True, map_location="cpu")
    return tensor_bytes(state.get("optimizer")) if isinstance(state, dict) else 0


def _latest_complete(store: Path) -> set[Path]:
    """The version directory ``latest.json`` names (the newest with its trainer state), when it exists."""
    try:
        version = orjson.loads((store / "latest.json").read_bytes())["version"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return set()
    d = store / f"v{int(version):06d}"
    return {d} if d.is_dir() else set()


def plan_run(run_dir: Path, everything: bool) -> RunPlan:
    """What cleaning ``run_dir`` would remove (see the module docstring); nothing is deleted."""
    plan = RunPlan(run_dir)
    live = live_pids(run_dir)
    if live:
        plan.skipped = f"running (live pid {', '.join(map(str, live))} in flywheel.json)"
        return plan
    for store in stores(run_dir):
        versions = sorted(d for d in store.iterdir() if d.is_dir() and _VERSION.match(d.name))
        partial = sorted(store.glob("*.tmp")) + sorted(store.glob("v*/*.tmp"))
        if everything:
            plan.remove.append(store)
            continue
        keep = set(versions[-1:]) | _latest_complete(store)
        plan.remove += [d for d in versions if d not in keep] + partial
        for kept in sorted(keep):
            plan.remove += [f for f in [kept / "optimizer.pt"] if f.exists()]
            ts = kept / "trainer_state.pt"
            if ts.exists() and not (kept / "optimizer.pt").exists():
                n = _embedded_optimizer_bytes(ts)  # the older layout: the optimizer inside (mmap: cheap)
                if n:
                    plan.rewrite.append(ts)
                    plan.bytes += n
    plan.bytes += sum(_size(p) for p in plan.remove)
    return plan


def _rewrite_without_optimizer(state_file: Path) -> None:
    """Write ``state_file`` again with ``optimizer: None`` (temporary file with the same mode, then rename)."""
    import torch

    state = torch.load(state_file, weights_only=False, map_location="cpu")
    state["optimizer"] = None
    tmp = state_file.with_name(state_file.name + ".tmp")
    mode = state_file.stat().st_mode & 0o777
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
        torch.save(state, f)
    os.replace(tmp, state_file)


def apply_plan(plan: RunPlan) -> int:
    """Delete and rewrite what ``plan`` lists; returns the bytes freed (measured: a rewrite's real saving).

    Raises:
        OSError: a file cannot be removed or rewritten.
    """
    freed = sum(_size(p) for p in plan.remove)
    for p in plan.remove:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    for ts in plan.rewrite:
        before = ts.stat().st_size
        _rewrite_without_optimizer(ts)
        freed += before - ts.stat().st_size
    return freed


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def clean_cmd(
    paths: Annotated[Optional[list[Path]], typer.Argument(
        help="Run directories, or directories of runs (default: .flywheel and runs).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove every checkpoint of the run, the newest weights too.")]
    = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go and the bytes freed; delete "
                                                            "nothing.")] = False,
) -> None:
    """Free finished runs' bulk: optimizer state and all but the newest weights (everything with --all).

    Running systems are skipped; reports, logs and the registry are kept.
    """
    roots = list(paths) if paths else [p for p in DEFAULT_ROOTS if p.exists()]
    missing = [p for p in roots if not p.exists()]
    if missing:
        console.print(f"[red]no such directory: {', '.join(map(str, missing))}[/]")
        raise typer.Exit(1)
    plans = [plan_run(d, all_) for d in run_dirs(roots)]
    freed = 0
    for plan in plans:
        if plan.skipped:
            console.print(f"[yellow]skipped[/] {plan.run_dir}: {plan.skipped}")
            continue
        what = [str(p.relative_to(plan.run_dir)) for p in plan.remove] + [
            f"{p.relative_to(plan.run_dir)} (optimizer state dropped)" for p in plan.rewrite]
        if not what:
            console.print(f"{plan.run_dir}: nothing to free")
            continue
        if not dry_run:
            plan.bytes = apply_plan(plan)
        freed += plan.bytes
        console.print(f"{'would free' if dry_run else '[green]freed[/]'} {plan.bytes} bytes in {plan.run_dir}:")
        for w in what:
            console.print(f"  {w}", highlight=False)
    verb = "would free" if dry_run else "freed"
    console.print(f"{verb} {freed} bytes ({_gb(freed)}) in {sum(not p.skipped for p in plans)} runs"
                  f"{'' if plans else ' (no run directory found)'}", highlight=False)
