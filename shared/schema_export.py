"""Published JSON Schemas of the topics: ``docs/schemas/<topic>.json``, one per topic, generated from the
pydantic records of :mod:`shared.schemas`.

``python -m shared.schema_export`` writes them; ``--check`` writes nothing and exits 1 when a file is missing,
stale or extra. Each file is a JSON Schema, draft 2020-12, of the topic's record type (``model_json_schema``
in ``validation`` mode: what :func:`shared.schemas.decode` accepts; for these records it is identical to the
``serialization`` mode, what ``Record.encode`` writes), with:

- ``$id`` ``urn:flywheel:schema:<topic>:v<version>``, ``title`` ``<topic>: <SCHEMA>``;
- ``x-flywheel-topic``, ``x-flywheel-schema`` (the record's ``SCHEMA``) and ``x-flywheel-schema-version``
  (its ``VERSION``, the ``schema_version`` every record carries).

Compatibility (``docs/schemas/README.md``): within one schema version a schema may only gain optional fields
(not required; they carry defaults). :func:`compatibility_problems` checks that against a committed file;
the writer refuses to overwrite a file with an incompatible schema of the same version.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from shared import topics
from shared.schemas import (
    Alert,
    Control,
    DeadLetter,
    GroupDropped,
    Metrics,
    Record,
    RewardEvent,
    RolloutRequest,
    ScoredTrajectory,
    Task,
    Trajectory,
    WeightUpdate,
)

DRAFT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "docs" / "schemas"
"""Where the files live in the repository (``docs/schemas``)."""

TOPIC_RECORDS: dict[str, type[Record]] = {
    topics.TASKS: Task,
    topics.ROLLOUT_REQUESTS: RolloutRequest,
    topics.TRAJECTORIES: Trajectory,
    topics.SCORED: ScoredTrajectory,
    topics.REWARDS: RewardEvent,
    topics.WEIGHTS: WeightUpdate,
    topics.METRICS: Metrics,
    topics.GROUP_DROPS: GroupDropped,
    topics.ALERTS: Alert,
    topics.CONTROL: Control,
    topics.DLQ: DeadLetter,
}
"""The record type of each topic. A pool's request topic (``flywheel.rollout.requests.<pool>``) carries
RolloutRequest too and shares its file."""

_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated")
"""Keywords that describe a value without constraining it: left out when two schemas' types are compared."""


def topic_schema(topic: str) -> dict[str, Any]:
    """The published JSON Schema of ``topic``'s record.

    Raises:
        KeyError: ``topic`` is not in :data:`TOPIC_RECORDS`.
    """
    cls = TOPIC_RECORDS[topic]
    body = cls.model_json_schema(mode="validation")
    head = {
        "$schema": DRAFT,
        "$id": f"urn:flywheel:schema:{topic}:v{cls.VERSION}",
        "title": f"{topic}: {cls.SCHEMA}",
        "x-flywheel-topic": topic,
        "x-flywheel-schema": cls.SCHEMA,
        "x-flywheel-schema-version": cls.VERSION,
    }
    body.pop("title", None)
    return {**head, **body}


def render(schema: dict[str, Any]) -> str:
    """The file text of ``schema``: two-space indented JSON, keys in generation order, a final newline."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    """``{file name: text}`` of every schema file, generated now (nothing is read or written)."""
    return {f"{t}.json": render(topic_schema(t)) for t in TOPIC_RECORDS}


def _strip(node: Any) -> Any:
    """``node`` without annotation keywords, recursively (the part of a schema that constrains values)."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k not in _ANNOTATIONS}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _object_problems(where: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    old_p, new_p = old.get("properties", {}), new.get("properties", {})
    old_req, new_req = set(old.get("required", [])), set(new.get("required", []))
    for name, spec in old_p.items():
        if name not in new_p:
            out.append(f"{where}.{name}: removed (or renamed)")
        elif _strip(spec) != _strip(new_p[name]):
            was, now = json.dumps(_strip(spec)), json.dumps(_strip(new_p[name]))
            out.append(f"{where}.{name}: type changed from {was} to {now}")
    for name in sorted(new_req - old_req):
        out.append(f"{where}.{name}: " + ("newly required" if name in old_p else "added as a required field"))
    if old.get("additionalProperties") != new.get("additionalProperties"):
        out.append(f"{where}: additionalProperties changed from {old.get('additionalProperties')!r} "
                   f"to {new.get('additionalProperties')!r}")
    return out


def compatibility_problems(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why ``new`` may not replace ``old`` (the committed schema of the same topic) without a version bump;
    empty when it may.

    With equal ``x-flywheel-schema-version`` and ``x-flywheel-schema``, ``new`` may only add optional fields:
    every field of ``old`` (at the top and in every object of ``$defs``) must still exist with the same type
    (its schema with the annotation keywords title, description, default and examples left out: a changed
    constraint, format, enum member or ``$ref`` is a type change), no field may become required, and every
    ``$defs`` entry of ``old`` must still exist unchanged in kind. A higher version may change anything; a
    lower one is a problem.
    """
    ov, nv = old.get("x-flywheel-schema-version"), new.get("x-flywheel-schema-version")
    if nv is None or ov is None:
        return ["x-flywheel-schema-version missing"]
    if nv > ov:
        return []
    if nv < ov:
        return [f"schema version went down from {ov} to {nv}"]
    if old.get("x-flywheel-schema") != new.get("x-flywheel-schema"):
        return [f"schema name changed from {old.get('x-flywheel-schema')!r} to {new.get('x-flywheel-schema')!r} "
                f"within version {nv}"]
    out = _object_problems("<record>", old, new)
    old_defs, new_defs = old.get("$defs", {}), new.get("$defs", {})
    for name, spec in old_defs.items():
        if name not in new_defs:
            out.append(f"$defs.{name}: removed (or renamed)")
        elif "properties" in spec:
            out.extend(_object_problems(f"$defs.{name}", spec, new_defs[name]))
        elif _strip(spec) != _strip(new_defs[name]):
            out.append(f"$defs.{name}: changed")
    return out


def lenient(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` that ignores unknown fields (every ``additionalProperties: false`` dropped):
    how a consumer following the compatibility rule validates records written by a newer producer."""
    s = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("additionalProperties") is False:
                del node["additionalProperties"]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def write(directory: Path = SCHEMA_DIR, check: bool = False) -> list[str]:
    """Write (or with ``check``, compare) every schema file under ``directory``; returns the problems found.

    Writing: a file whose schema is incompatible with the one already there under the same version is not
    overwritten (the problem is returned: bump the record's ``VERSION``); other files are written when they
    changed. Checking: a file missing, different from what would be written, or not belonging to a topic
    is a problem.
    """
    problems: list[str] = []
    want = expected_files()
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in want.items():
        path = directory / name
        have = path.read_text() if path.exists() else None
        if have == text:
            continue
        if have is not None:
            compat = compatibility_problems(json.loads(have), json.loads(text))
            problems += [f"{name}: {p} (bump {json.loads(text)['x-flywheel-schema']}'s VERSION)" for p in compat]
            if compat:
                continue
        if check:
            problems.append(f"{name}: {'missing' if have is None else 'out of date'}")
        else:
            path.write_text(text)
    extra = sorted(p.name for p in directory.glob("*.json") if p.name not in want)
    problems += [f"{name}: no topic has this schema (remove it)" for name in extra]
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m shared.schema_export [--check] [--dir DIR]``; exit status 0 or 1."""
    ap = argparse.ArgumentParser(prog="python -m shared.schema_export", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is missing or stale")
    ap.add_argument("--dir", type=Path, default=SCHEMA_DIR, help=f"output directory (default {SCHEMA_DIR})")
    args = ap.parse_args(argv)
    problems = write(args.dir, check=args.check)
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(TOPIC_RECORDS)} schemas {'up to date' if args.check else 'written'} in {args.dir}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
