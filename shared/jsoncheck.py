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




def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact JSON (orjson, what the registry and Kafka store).

    Raises:
        ValueError: it cannot be encoded (an integer past 64 bits, a non-string key...).
    """
    import orjson

    try:
        return len(orjson.dumps(value))
    except TypeError as e:  # orjson.JSONEncodeError is a TypeError
        raise ValueError(f"cannot be encoded as JSON: {e}") from None


def check_size(value: Any, max_bytes: int, what: str = "value") -> Any:
    """``value`` unchanged when its compact JSON holds at most ``max_bytes`` bytes.

    Raises:
        ValueError: it is larger (the message names ``what`` and both sizes), or cannot be encoded.
    """
    n = json_size(value)
    if n > max_bytes:
        raise ValueError(f"{what} is {n} bytes as JSON, more than {max_bytes}")
    return value
