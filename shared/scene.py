"""3D scenes for the ``geometry`` verifier: the JSON format a model emits and the constraints checked on it.

Scene format (z is up, the ground is the plane z = 0, units are free but shared by all numbers)::

    {"primitives": [
      {"type": "box",      "center": [x, y, z], "size": [sx, sy, sz]},
      {"type": "sphere",   "center": [x, y, z], "radius": r},
      {"type": "cylinder", "center": [x, y, z], "radius": r, "height": h}
    ]}

Boxes are axis-aligned; a cylinder's axis is vertical and ``center`` is its middle. A bare list of
primitives is accepted too. Constraints (each may carry ``weight``, default 1):

* ``{"type": "count", "shape": "box"|"sphere"|"cylinder"|null, "min": n, "max": n}``
* ``{"type": "inside", "min": [x, y, z], "max": [x, y, z]}``: every primitive lies in that box.
* ``{"type": "volume", "min": v, "max": v}``: the summed volume of the primitives.
* ``{"type": "height", "min": h, "max": h}``: the highest point of the scene.
* ``{"type": "no_overlap"}``: no two primitives interpenetrate by more than the tolerance.
* ``{"type": "supported"}``: every primitive rests on the ground or on top of another one (its bottom
  at the other's top and their footprints overlapping), and nothing is below the ground.

All checks are exact for these shapes except sphere–cylinder overlap, which uses the closest point of
the solid cylinder (exact too, for a solid). Pure Python, no dependencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_PRIMITIVES = 256
MAX_COORD = 1e6
"""Largest magnitude of a coordinate or dimension (scene units): keeps every volume and distance finite."""
SHAPES = ("box", "sphere", "cylinder")
_CONSTRAINT_KEYS = {
    "count": ({"min", "max", "shape"}, set()),
    "inside": ({"min", "max"}, {"min", "max"}),
    "volume": ({"min", "max"}, set()),
    "height": ({"min", "max"}, set()),
    "no_overlap": (set(), set()),
    "supported": (set(), set()),
}


class SceneError(ValueError):
    """The model's scene is not valid JSON in the format above (a model error: reward 0)."""


@dataclass(frozen=True)
class Primitive:
    """One solid: ``shape`` in SHAPES, centre (x, y, z), and its dimensions (scene units)."""

    shape: str
    center: tuple[float, float, float]
    size: tuple[float, float, float] = (0.0, 0.0, 0.0)  # box
    radius: float = 0.0  # sphere, cylinder
    height: float = 0.0  # cylinder

    @property
    def zmin(self) -> float:
        return self.center[2] - self._half_z

    @property
    def zmax(self) -> float:
        return self.center[2] + self._half_z

    @property
    def _half_z(self) -> float:
        if self.shape == "box":
            return self.size[2] / 2
        return self.radius if self.shape == "sphere" else self.height / 2

    def aabb(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """Axis-aligned bounds ((x0, y0, z0), (x1, y1, z1))."""
        c = self.center
        h = (tuple(s / 2 for s in self.size) if self.shape == "box"
             else (self.radius, self.radius, self._half_z))
        return (c[0] - h[0], c[1] - h[1], c[2] - h[2]), (c[0] + h[0], c[1] + h[1], c[2] + h[2])

    def volume(self) -> float:
        if self.shape == "box":
            return self.size[0] * self.size[1] * self.size[2]
        if self.shape == "sphere":
            return 4.0 / 3.0 * math.pi * self.radius ** 3
        return math.pi * self.radius ** 2 * self.height


def _num(v: Any, what: str, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > MAX_COORD:
        raise SceneError(f"{what} must be a number within ±{MAX_COORD:g}, got {v!r}")
    if positive and v <= 0:
        raise SceneError(f"{what} must be > 0, got {v!r}")
    return float(v)


def _vec(v: Any, what: str, positive: bool = False) -> tuple[float, float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 3:
        raise SceneError(f"{what} must be a list of 3 numbers, got {v!r}")
    return tuple(_num(x, f"{what}[{i}]", positive) for i, x in enumerate(v))  # type: ignore[return-value]


def parse_scene(data: Any) -> list[Primitive]:
    """Primitives of a decoded scene (``{"primitives": [...]}`` or a bare list).

    Raises:
        SceneError: wrong structure, unknown shape, missing or non-positive dimensions, too many primitives.
    """
    items = data.get("primitives") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise SceneError('a scene is {"primitives": [...]} or a list of primitives')
    if len(items) > MAX_PRIMITIVES:
        raise SceneError(f"more than {MAX_PRIMITIVES} primitives")
    out = []
    for i, p in enumerate(items):
        if not isinstance(p, dict):
            raise SceneError(f"primitive {i} is not an object")
        shape = p.get("type")
        if shape not in SHAPES:
            raise SceneError(f"primitive {i}: type must be one of {list(SHAPES)}, got {shape!r}")
        allowed = {"type", "center", "size"} if shape == "box" else {"type", "center", "radius"} | (
            {"height"} if shape == "cylinder" else set())
        extra = sorted(set(p) - allowed)
        if extra:
            raise SceneError(f"primitive {i} ({shape}): unknown key(s) {extra}")
        center = _vec(p.get("center"), f"primitive {i} center")
        if shape == "box":
            out.append(Primitive("box", center, size=_vec(p.get("size"), f"primitive {i} size", positive=True)))
        elif shape == "sphere":
            out.append(Primitive("sphere", center, radius=_num(p.get("radius"), f"primitive {i} radius", True)))
        else:
            out.append(Primitive("cylinder", center, radius=_num(p.get("radius"), f"primitive {i} radius", True),
                                 height=_num(p.get("height"), f"primitive {i} height", True)))
    return out


def scene_json(prims: list[Primitive]) -> dict[str, Any]:
    """The JSON form of ``prims`` (inverse of :func:`parse_scene`)."""
    out = []
    for p in prims:
        d: dict[str, Any] = {"type": p.shape, "center": list(p.center)}
        if p.shape == "box":
            d["size"] = list(p.size)
        else:
            d["radius"] = p.radius
            if p.shape == "cylinder":
                d["height"] = p.height
        out.append(d)
    return {"primitives": out}


def validate_constraint(c: Any) -> None:
    """Check one constraint's structure (for task validation at submission).

    Raises:
        ValueError: unknown type, unknown keys, missing vectors, bad numbers or shapes.
    """
    if not isinstance(c, dict):
        raise ValueError("a constraint is an object")
    kind = c.get("type")
    if kind not in _CONSTRAINT_KEYS:
        raise ValueError(f"type must be one of {sorted(_CONSTRAINT_KEYS)}, got {kind!r}")
    allowed, required = _CONSTRAINT_KEYS[kind]
    extra = sorted(set(c) - allowed - {"type", "weight"})
    if extra:
        raise ValueError(f"unknown key(s) {extra} for {kind!r}")
    missing = sorted(required - set(c))
    if missing:
        raise ValueError(f"missing key(s) {missing} for {kind!r}")
    try:
        if "weight" in c:
            _num(c["weight"], "weight", positive=True)  # at most 1e6: sums of weights stay finite
        if kind == "inside":
            lo, hi = _vec(c["min"], "min"), _vec(c["max"], "max")
            if any(a > b for a, b in zip(lo, hi)):
                raise ValueError("min must be <= max on every axis")
        else:
            for k in ("min", "max"):
                if k in c and c[k] is not None:
                    _num(c[k], k)
        if kind == "count" and c.get("shape") not in (None, *SHAPES):
            raise ValueError(f"shape must be one of {list(SHAPES)} or null")
        if c.get("min") is not None and c.get("max") is not None and kind != "inside" and c["min"] > c["max"]:
            raise ValueError("min must be <= max")
    except SceneError as e:
        raise ValueError(str(e)) from e


# ---------------------------------------------------------------- geometry of pairs


def _clamp(v: float, lo: float, hi: float) -> float:
    return lo if v < lo else hi if v > hi else v


def _axis_overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return min(a1, b1) - max(a0, b0)


def penetration(a: Primitive, b: Primitive) -> float:
    """How deep ``a`` and ``b`` interpenetrate (scene units; ≤ 0 when they are apart or just touch)."""
    (ax0, ay0, az0), (ax1, ay1, az1) = a.aabb()
    (bx0, by0, bz0), (bx1, by1, bz1) = b.aabb()
    if a.shape == "sphere" and b.shape != "sphere":
        a, b = b, a
    if b.shape == "sphere":
        c, r = b.center, b.radius
        if a.shape == "sphere":
            return a.radius + r - math.dist(a.center, c)
        (x0, y0, z0), (x1, y1, z1) = a.aabb()
        if a.shape == "box":
            q = (_clamp(c[0], x0, x1), _clamp(c[1], y0, y1), _clamp(c[2], z0, z1))
        else:  # solid cylinder: clamp radially and along the axis
            dx, dy = c[0] - a.center[0], c[1] - a.center[1]
            d = math.hypot(dx, dy)
            k = 1.0 if d <= a.radius else a.radius / d
            q = (a.center[0] + dx * k, a.center[1] + dy * k, _clamp(c[2], z0, z1))
        return r - math.dist(q, c)
    dz = _axis_overlap(az0, az1, bz0, bz1)
    if a.shape == "box" and b.shape == "box":
        return min(_axis_overlap(ax0, ax1, bx0, bx1), _axis_overlap(ay0, ay1, by0, by1), dz)
    if a.shape == "cylinder" and b.shape == "cylinder":
        return min(dz, a.radius + b.radius - math.dist(a.center[:2], b.center[:2]))
    box, cyl = (a, b) if a.shape == "box" else (b, a)
    (x0, y0, _), (x1, y1, _) = box.aabb()
    cx, cy = cyl.center[0], cyl.center[1]
    inside = x0 <= cx <= x1 and y0 <= cy <= y1
    d = math.hypot(cx - _clamp(cx, x0, x1), cy - _clamp(cy, y0, y1))
    return min(dz, cyl.radius + (min(cx - x0, x1 - cx, cy - y0, y1 - cy) if inside else -d))


def _footprint_overlap(top: Primitive, upper: Primitive, tol: float) -> bool:
    """Whether ``upper``'s bottom face and ``top``'s top face share more than a tolerance of area (a
    sphere's face is its pole, a point, which must lie inside the other face)."""
    def shape2d(p: Primitive) -> tuple[str, tuple[float, float], float, float]:
        if p.shape == "box":
            return "rect", p.center[:2], p.size[0] / 2, p.size[1] / 2
        if p.shape == "cylinder":
            return "circle", p.center[:2], p.radius, p.radius
        return "point", p.center[:2], 0.0, 0.0

    ka, ca, ha, wa = shape2d(top)
    kb, cb, hb, wb = shape2d(upper)
    if ka == "point" and kb == "point":
        return False  # two poles touch at one point: not a stable rest
    if kb == "point" or ka == "point":
        (kk, cc, hh, ww), pt = ((ka, ca, ha, wa), cb) if kb == "point" else ((kb, cb, hb, wb), ca)
        if kk == "rect":
            return abs(pt[0] - cc[0]) <= hh - tol and abs(pt[1] - cc[1]) <= ww - tol
        return math.dist(pt, cc) <= hh - tol
    if ka == "rect" and kb == "rect":
        return (_axis_overlap(ca[0] - ha, ca[0] + ha, cb[0] - hb, cb[0] + hb) > tol
                and _axis_overlap(ca[1] - wa, ca[1] + wa, cb[1] - wb, cb[1] + wb) > tol)
    if ka == "circle" and kb == "circle":
        return ha + hb - math.dist(ca, cb) > tol
    (rc, rh, rw), (cc, cr) = ((ca, ha, wa), (cb, hb)) if ka == "rect" else ((cb, hb, wb), (ca, ha))
    q = (_clamp(cc[0], rc[0] - rh, rc[0] + rh), _clamp(cc[1], rc[1] - rw, rc[1] + rw))
    inside = q == tuple(cc)
    return inside or cr - math.dist(q, cc) > tol


def _is_supported(i: int, prims: list[Primitive], tol: float) -> bool:
    p = prims[i]
    if abs(p.zmin) <= tol:
        return True
    return any(j != i and abs(q.zmax - p.zmin) <= tol and _footprint_overlap(q, p, tol) for j, q in enumerate(prims))


# ---------------------------------------------------------------- constraints


def _in_range(v: float, c: dict[str, Any], tol: float) -> bool:
    lo, hi = c.get("min"), c.get("max")
    return (lo is None or v >= lo - tol) and (hi is None or v <= hi + tol)


def check_constraint(c: dict[str, Any], prims: list[Primitive], tol: float) -> tuple[bool, str]:
    """Whether ``prims`` meet constraint ``c`` (already validated), with a short reason when not."""
    kind = c["type"]
    if kind == "count":
        n = sum(1 for p in prims if c.get("shape") in (None, p.shape))
        return _in_range(n, c, 0), f"{n} {c.get('shape') or 'primitive'}(s)"
    if kind == "inside":
        lo, hi = c["min"], c["max"]
        out = [i for i, p in enumerate(prims)
               if any(a < l - tol for a, l in zip(p.aabb()[0], lo)) or any(b > h + tol for b, h in zip(p.aabb()[1], hi))]
        return not out, f"primitives {out} outside" if out else "all inside"
    if kind == "volume":
        v = sum(p.volume() for p in prims)
        return _in_range(v, c, tol), f"volume {v:.4g}"
    if kind == "height":
        h = max((p.zmax for p in prims), default=0.0)
        return _in_range(h, c, tol), f"height {h:.4g}"
    if kind == "no_overlap":
        pairs = [(i, j) for i in range(len(prims)) for j in range(i + 1, len(prims))
                 if penetration(prims[i], prims[j]) > tol]
        return not pairs, f"overlapping pairs {pairs[:5]}" if pairs else "no overlap"
    if kind == "supported":
        below = [i for i, p in enumerate(prims) if p.zmin < -tol]
        floating = [i for i in range(len(prims)) if i not in below and not _is_supported(i, prims, tol)]
        ok = not below and not floating
        return ok, "all supported" if ok else f"below ground {below}, unsupported {floating}"
    raise ValueError(f"unknown constraint {kind!r}")  # validate_constraint rules this out


def score_scene(prims: list[Primitive], constraints: list[dict[str, Any]], tol: float) -> tuple[float, list[dict]]:
    """Weighted fraction of ``constraints`` met by ``prims`` in [0, 1], and one result per constraint."""
    results, got, total = [], 0.0, 0.0
    seen: dict[str, tuple[bool, str]] = {}
    for c in constraints:
        key = repr(sorted((k, repr(v)) for k, v in c.items() if k != "weight"))
        if key not in seen:  # a spec may repeat an O(n²) check: compute it once
            seen[key] = check_constraint(c, prims, tol)
        ok, why = seen[key]
        w = float(c.get("weight", 1.0))
        total += w
        got += w if ok else 0.0
        results.append({"type": c["type"], "ok": ok, "detail": why})
    return (got / total if total else 0.0), results
