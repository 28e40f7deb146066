"""Checks that free-form JSON values can travel through the registry and Kafka exactly."""

from __future__ import annotations

import math
from typing import Any

MAX_JSON_DEPTH = 32
"""Deepest nesting accepted in free-form JSON fields (metadata, dataset entries)."""


def check_json(value: Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """``value`` unchanged when it is JSON the registry and Kafka can carry exactly.

    Raises:
        ValueError: nested deeper than ``limit``, an integer outside 64 bits (orjson cannot encode
            it), or a NaN/Infinity float (JSON has none; it would silently become null).
    """
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                raise ValueError(f"nested deeper than {limit} levels")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int) and not -(2**63) <= v < 2**64:
            raise ValueError(f"integer {v} does not fit in 64 bits")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{v} is not a finite number (JSON has no NaN or Infinity)")
    return value


