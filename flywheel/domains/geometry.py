"""Synthetic 3D construction tasks checked by geometric constraints (``shared.scene``).

Three families, with random sizes and counts:

* ``tower``: stack n equal cubes on the ground, inside a bounding box, to an exact height;
* ``row``: n spheres resting on the ground, none touching another's interior, inside a box;
* ``table``: a box tabletop carried by four cylinder legs, at a given height.

The reference scene is kept in the task's metadata (the gold completion); the constraints, not the
reference, decide the reward, so any valid construction scores 1.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

from flywheel.domains.common import task_body, with_recipe
from shared.scene import Primitive, scene_json

RECIPE: dict[str, Any] | None = {
    "reason": "no truncation gate: the scene is one JSON object, which does not parse when it is cut off; "
              "a response cut off after it closed holds a complete scene"}
"""An explicit opt-out of the verifier's default truncation gate, with its reason (the verifier service's
recipe for the domain still applies when it has one; ``shared.verifier_specs.Recipe.opts_out``)."""

SYSTEM = ('Build the requested 3D scene. Reply with one JSON object inside <answer></answer> tags: '
          '{"primitives": [...]} where each primitive is {"type": "box", "center": [x, y, z], "size": [sx, sy, sz]}, '
          '{"type": "sphere", "center": [x, y, z], "radius": r} or {"type": "cylinder", "center": [x, y, z], '
          '"radius": r, "height": h}. Boxes are axis-aligned, cylinders stand upright, z is up, the ground is '
          'z = 0 and center is the middle of the solid.')


def _tower(rng: random.Random) -> tuple[str, list[dict], list[Primitive]]:
    n, s = rng.randint(2, 6), rng.choice([0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0])
    prims = [Primitive("box", (0.0, 0.0, s / 2 + i * s), size=(s, s, s)) for i in range(n)]
    half = s * 1.5
    text = (f"Stack {n} cubes of side {s} into a single tower standing on the ground, each cube resting on the one "
            f"below. The tower must fit inside the box from ({-half}, {-half}, 0) to ({half}, {half}, {n * s + s}) "
            f"and be exactly {n * s} tall.")
    cons = [{"type": "count", "shape": "box", "min": n, "max": n},
            {"type": "supported"}, {"type": "no_overlap"},
            {"type": "inside", "min": [-half, -half, 0], "max": [half, half, n * s + s]},
            {"type": "height", "min": n * s, "max": n * s},
            {"type": "volume", "min": n * s ** 3, "max": n * s ** 3}]
    return text, cons, prims


def _row(rng: random.Random) -> tuple[str, list[dict], list[Primitive]]:
    n, r = rng.randint(2, 5), rng.choice([0.25, 0.5, 0.75, 1.0, 1.25, 1.5])
    gap = rng.choice([0.0, 0.25, 0.5, 1.0])
    length = n * 2 * r + (n - 1) * gap
    prims = [Primitive("sphere", (-length / 2 + r + i * (2 * r + gap), 0.0, r), radius=r) for i in range(n)]
    text = (f"Place {n} spheres of radius {r} resting on the ground in a row along the x axis, without any two "
            f"overlapping, all inside the box from ({-length / 2}, {-r}, 0) to ({length / 2}, {r}, {2 * r}).")
    cons = [{"type": "count", "shape": "sphere", "min": n, "max": n}, {"type": "supported"}, {"type": "no_overlap"},
            {"type": "inside", "min": [-length / 2, -r, 0], "max": [length / 2, r, 2 * r]}]
    return text, cons, prims


def _table(rng: random.Random) -> tuple[str, list[dict], list[Primitive]]:
    w, d = rng.choice([1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0]), rng.choice([1.0, 1.5, 2.0, 2.5, 3.0])
    h, t, leg_r = rng.choice([0.8, 1.0, 1.2, 1.5, 1.8, 2.0, 2.4]), 0.1, 0.1
    legs = [Primitive("cylinder", (sx * (w / 2 - 0.2), sy * (d / 2 - 0.2), (h - t) / 2), radius=leg_r, height=h - t)
            for sx in (-1, 1) for sy in (-1, 1)]
    prims = legs + [Primitive("box", (0.0, 0.0, h - t / 2), size=(w, d, t))]
    text = (f"Build a table: a tabletop box {w} wide (x), {d} deep (y) and {t} thick, whose top surface is at height "
            f"{h}, carried by exactly 4 upright cylinder legs of radius {leg_r} standing on the ground. Nothing may "
            f"float or overlap, and the table must fit in the box from ({-w / 2}, {-d / 2}, 0) to ({w / 2}, {d / 2}, {h}).")
    cons = [{"type": "count", "shape": "cylinder", "min": 4, "max": 4}, {"type": "count", "shape": "box", "min": 1, "max": 1},
            {"type": "supported"}, {"type": "no_overlap"}, {"type": "height", "min": h, "max": h},
            {"type": "inside", "min": [-w / 2, -d / 2, 0], "max": [w / 2, d / 2, h]}]
    return text, cons, prims


FAMILIES = {"tower": _tower, "row": _row, "table": _table}


def make(n: int, seed: int = 0, split: str = "train", families: list[str] | None = None,
         samples_per_task: int = 8, recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """``n`` construction tasks cycling through ``families`` (default all three), each carrying ``recipe``
    when one is given (default :data:`RECIPE`).

    Raises:
        ValueError: ``recipe`` is not a valid recipe.
    """
    rng = random.Random(f"geometry:{split}:{seed}")
    fams = families or list(FAMILIES)
    out = []
    for i in range(n):
        fam = fams[i % len(fams)]
        text, cons, prims = FAMILIES[fam](rng)
        out.append(task_body("geometry", split, f"{seed}:{i}:{text}", text,
                             with_recipe({"kind": "geometry", "constraints": cons}, recipe), system=SYSTEM,
                             samples_per_task=samples_per_task,
                             metadata={"family": fam, "reference": scene_json(prims)}))
    return out


def gold(task: dict) -> str:
    return "<answer>" + orjson.dumps(task["metadata"]["reference"]).decode() + "</answer>"


def corrupt(task: dict, rng: random.Random) -> str:
    """The reference with its last primitive lifted off its support, or pushed into its neighbour, or dropped."""
    prims = [dict(p) for p in task["metadata"]["reference"]["primitives"]]
    how = rng.choice(["lift", "overlap", "drop"])
    last = prims[-1]
    if how == "lift":
        last["center"] = [last["center"][0], last["center"][1], last["center"][2] + 0.37]
    elif how == "overlap":
        other = prims[0]
        last["center"] = [other["center"][0] + 0.05, other["center"][1], other["center"][2]]
    else:
        prims = prims[:-1]
    return "<answer>" + orjson.dumps({"primitives": prims}).decode() + "</answer>"
