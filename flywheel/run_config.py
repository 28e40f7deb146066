"""The resolved config a run was started with, saved in its run directory (``flywheel-config.json``), for what
reads the run afterwards (``flywheel export``'s model card). Light to import: the CLI writes it at every start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

RUN_CONFIG_FILE = "flywheel-config.json"
"""The saved config's file name in the run directory."""


def save_run_config(run_dir: str | os.PathLike, config: Any) -> Path:
    """Write the resolved root config (a :class:`flywheel.config.FlywheelConfig`) to ``<run_dir>/``
    :data:`RUN_CONFIG_FILE` (mode 0600; ``auth.token`` left out), so that an export can say what trained the model.

    Raises:
        OSError: the run directory is not writable.
    """
    from shared.auth import write_private

    path = Path(run_dir) / RUN_CONFIG_FILE
    data = config.model_dump(mode="json", exclude={"auth": {"token"}})
    write_private(path, orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return path
