"""``flywheel clean`` on real run directories: frees the bulk of a finished run, skips a live one, and
``--dry-run`` deletes nothing."""

from __future__ import annotations

import os
import re

import orjson
import torch
import typer
from typer.testing import CliRunner

from flywheel.clean import clean_cmd
from shared.checkpoint import CheckpointStore

N = 50_000  # floats per tensor: 200 kB of weights, 400 kB of optimizer moments per version


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("clean")(clean_cmd)
    app.command("noop")(lambda: None)  # two commands: `clean` stays a sub-command
    return app


def _run(*args: str):
    r = CliRunner().invoke(_app(), ["clean", *args])
    assert r.exit_code == 0, r.output
    return r.output


def _finished_run(path, versions=3, keep=2, old_layout=False):
    """A run directory as a finished run leaves it: a checkpoint store, logs, a registry, a report."""
    store = CheckpointStore(path / "checkpoints", keep=keep)
    for v in range(1, versions + 1):
        state = {"step": v, "version": v, "done_groups": [], "optimizer": {"m": torch.ones(N), "v": torch.ones(N)}}
        store.save({"w": torch.full((N,), float(v))}, "m", v, v, state, [f"g{v}"])
    if old_layout:  # the older layout: the optimizer inside trainer_state.pt, in every version
        for d in store.root.glob("v*"):
            st = {"step": 1, "optimizer": {"m": torch.ones(4 * N), "v": torch.ones(4 * N)}}
            torch.save(st, d / "trainer_state.pt")
            (d / "optimizer.pt").unlink(missing_ok=True)
    (path / "logs").mkdir()
    (path / "logs" / "trainer.log").write_text("step 1\n")
    (path / "registry.sqlite").write_bytes(b"db")
    (path / "report.json").write_text("{}")
    return store


def _bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _freed(output: str) -> int:
    return int(re.search(r"(?:would free|freed) (\d+) bytes \(", output).group(1))


def test_clean_frees_a_finished_runs_bulk_and_dry_run_deletes_nothing(tmp_path):
    run = tmp_path / "runs" / "toy-1"
    store = _finished_run(run)
    before = _bytes(run)
    files = sorted(p for p in run.rglob("*"))

    dry = _run(str(tmp_path / "runs"), "--dry-run")
    assert sorted(p for p in run.rglob("*")) == files  # nothing deleted
    assert f"would free {_freed(dry)} bytes in {run}:" in dry and "checkpoints/v000003/optimizer.pt" in dry

    out = _run(str(tmp_path / "runs"))
    assert _freed(out) == _freed(dry) == before - _bytes(run) > 3 * N * 4  # v2 weights + v3 optimizer moments
    assert sorted(p.name for p in store.root.iterdir()) == ["latest.json", "v000003"]
    assert sorted(p.name for p in store.version_dir(3).iterdir()) == [
        "model.safetensors", "trained_groups.json", "trainer_state.pt", "update.json"]
    assert (run / "logs" / "trainer.log").exists() and (run / "registry.sqlite").exists()
    assert (run / "report.json").exists()
    # the policy stays loadable, its counters too (a restart at max_steps works; the optimizer is gone)
    assert store.latest().version == 3 and "optimizer" not in store.load_trainer_state(3)
    assert _freed(_run(str(run))) == 0  # a second pass has nothing left to free


def test_clean_skips_a_running_system(tmp_path):
    live, dead = tmp_path / "live", tmp_path / "dead"
    _finished_run(live)
    _finished_run(dead)
    (live / "flywheel.json").write_bytes(orjson.dumps({"supervisor_pid": os.getpid(), "broker_pid": None,
                                                       "services": {}}))
    (dead / "flywheel.json").write_bytes(orjson.dumps({"supervisor_pid": 2 ** 22 + 12345, "services": {}}))
    live_before = sorted(live.rglob("*"))
    out = _run(str(live), str(dead))
    assert sorted(live.rglob("*")) == live_before
    assert f"skipped {live}: running (live pid {os.getpid()}" in out, out
    assert not (dead / "checkpoints" / "v000002").exists()


def test_clean_all_removes_every_checkpoint_and_rewrites_an_old_layout_state(tmp_path):
    old, gone = tmp_path / "old", tmp_path / "gone"
    store = _finished_run(old, old_layout=True)
    _finished_run(gone)
    state_before = (store.version_dir(3) / "trainer_state.pt").stat().st_size
    _run(str(old))
    after = store.load_trainer_state(3)
    assert after["optimizer"] is None and after["step"] == 1
    assert (store.version_dir(3) / "trainer_state.pt").stat().st_size < state_before / 100
    _run(str(gone), "--all")
    assert not (gone / "checkpoints").exists() and (gone / "logs" / "trainer.log").exists()


def test_clean_refuses_a_missing_path(tmp_path):
    r = CliRunner().invoke(_app(), ["clean", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "no such directory" in r.output
