"""Test helpers for real processes and filesystems: processes under a directory, a small tmpfs."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def procs_under(path: Path) -> list[int]:
    """Pids of processes whose working directory is ``path`` or below (the services run in the run dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cwd = os.readlink(d / "cwd").removesuffix(" (deleted)")
            except OSError:
                continue
            if cwd == str(path) or cwd.startswith(str(path) + "/"):
                out.append(int(d.name))
    return out


@contextlib.contextmanager
def small_tmpfs(parent: Path, size_mib: int) -> Iterator[Path]:
    """A ``size_mib`` MiB tmpfs mounted at ``parent/small`` (needs root: the test is skipped otherwise),
    unmounted on exit."""
    d = parent / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(d)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)
