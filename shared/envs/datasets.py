"""Rows of an environment's dataset, from the files users already have, in one normalised shape.

Sources: a list of dicts; JSONL (``.jsonl``); JSON (``.json``, a list of objects); Parquet (``.parquet``); CSV
(``.csv``, every value a string); a Hugging Face ``datasets`` folder written by ``save_to_disk`` (read with
``load_from_disk``: local files only, never the hub at run time). Shapes read as they are:

- ``prompt`` (text, or chat messages) or ``question`` (text), ``answer``, ``info``: the ``verifiers`` library's
  and TRL's columns;
- verl's parquet convention: ``prompt`` (messages), ``reward_model.ground_truth`` (the answer), ``extra_info``
  (the info), ``data_source`` (kept in the row).

A column mapping ``{flywheel_name: dataset_column}`` renames columns first.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Iterable

import orjson

MAX_ROWS = 1_000_000
"""Most rows read from one source."""


class DatasetError(ValueError):
    """A dataset cannot be read or a row lacks what a task needs; the message names the source, the row and the
    column, and the columns the row has."""


def read_source(source: Any, split: str = "train") -> Iterable[dict]:
    """The raw rows of ``source``: a list of dicts as is, a ``.jsonl`` (one object per line), ``.json`` (an
    array), ``.parquet`` or ``.csv`` file, or a folder written by ``datasets``' ``save_to_disk`` (its ``split``).

    Raises:
        DatasetError: not a file or folder, an unknown format, or a missing split.
        orjson.JSONDecodeError: a JSON(L) file that is not JSON (raised while iterating for JSONL).
    """
    if isinstance(source, (list, tuple)):
        return source
    path = Path(source).expanduser()
    if path.is_dir():
        from datasets import DatasetDict, load_from_disk

        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            if split not in data:
                raise DatasetError(f"{path}: no split {split!r} (splits: {sorted(data)})")
            data = data[split]
        return data
    if not path.is_file():
        raise DatasetError(f"dataset {str(path)!r} is not a file or a datasets folder")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return (orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip())
    if suffix == ".json":
        return orjson.loads(path.read_bytes())
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    raise DatasetError(f"dataset {str(path)!r}: unknown format {suffix!r} (.jsonl, .json, .parquet, .csv, or a "
                       "datasets folder)")


def normalise_row(row: dict[str, Any], columns: dict[str, str] | None = None, where: str = "row") -> dict[str, Any]:
    """One row as ``{prompt: [messages], answer, info, ...the rest}``.

    Raises:
        DatasetError: the row is not an object, a mapped column is missing (the message names it and the
            mapping), or it has neither ``prompt`` nor ``question`` (or both are null); the message names the
            columns the row has.
    """
    if not isinstance(row, dict):
        raise DatasetError(f"{where} is a {type(row).__name__}, not an object")
    out = dict(row)
    for ours, theirs in (columns or {}).items():
        if theirs not in row:
            raise DatasetError(f"{where} has no column {theirs!r} (mapped to {ours!r}); columns: {sorted(row)}")
        out[ours] = row[theirs]
    prompt = out.get("prompt") if out.get("prompt") is not None else out.get("question")
    if prompt is None:
        empty = [c for c in ("prompt", "question") if c in out]
        raise DatasetError(f"{where} has no 'prompt' or 'question' column"
                           + (f" ({' and '.join(map(repr, empty))} empty)" if empty else "")
                           + f"; columns: {sorted(row)}; map one with columns: {{question: <column>}}")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                               for m in prompt)):
        raise DatasetError(f"{where}: 'prompt' is neither text nor a list of {{role, content}} messages")
    reward_model = out.get("reward_model") if isinstance(out.get("reward_model"), dict) else {}
    out["prompt"] = [{"role": m["role"], "content": m["content"]} for m in prompt]
    out["answer"] = out.get("answer", reward_model.get("ground_truth"))
    info = out.get("info", out.get("extra_info"))
    out["info"] = info if isinstance(info, dict) else {} if info is None else {"value": info}
    return out


def load_rows(source: Any, columns: dict[str, str] | None = None, split: str = "train",
              limit: int | None = None) -> list[dict[str, Any]]:
    """The normalised rows of ``source`` (see the module docstring), at most :data:`MAX_ROWS`, or only its first
    ``limit`` (``flywheel env check --rows``: the rows after them are neither decoded nor checked).

    Raises:
        DatasetError: unreadable source, unknown format, missing split, or a bad row (the first one found).
    """
    label = "dataset" if isinstance(source, (list, tuple)) else f"dataset {str(source)!r}"
    try:
        rows = read_source(source, split)
        out = []
        for i, row in enumerate(rows):
            if limit is not None and i >= limit:
                break
            if i >= MAX_ROWS:
                raise DatasetError(f"{label} has more than {MAX_ROWS} rows")
            out.append(normalise_row(dict(row) if not isinstance(row, dict) and hasattr(row, "keys") else row,
                                     columns, f"{label} row {i}"))
        return out
    except DatasetError:
        raise
    except (OSError, ValueError, orjson.JSONDecodeError) as e:
        raise DatasetError(f"{label} cannot be read: {type(e).__name__}: {e}") from e


def check_first_row(source: Any, columns: dict[str, str] | None = None, name: str = "dataset") -> None:
    """Normalise the first row of an in-memory dataset (a list or tuple of rows), so that a row without its prompt
    or a mapped column is found when the environment is built, not when its rows are first read. A path is not
    opened: the services that build an environment may run where a relative path names nothing, and one row of
    every format cannot be read without reading much more.

    Raises:
        DatasetError: as :func:`normalise_row`, for row 0 (the message calls it ``<name> row 0``).
    """
    if isinstance(source, (list, tuple)) and source:
        row = source[0]
        normalise_row(dict(row) if not isinstance(row, dict) and hasattr(row, "keys") else row, columns,
                      f"{name} row 0")
