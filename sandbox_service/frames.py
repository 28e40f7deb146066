"""Length-prefixed orjson frames on pipes: a 4-byte big-endian length, then the JSON body."""

from __future__ import annotations

import os
import struct

import orjson


def read_frame(fd: int, max_bytes: int | None = None) -> dict | None:
    """Read one frame from ``fd``; None at EOF before it.

    Raises:
        ValueError: a torn frame, or one longer than ``max_bytes``.
    """
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if max_bytes is not None and n > max_bytes:
        raise ValueError(f"frame of {n} bytes is larger than {max_bytes}")
    body = _read_exact(fd, n)
    if body is None:
        raise ValueError("EOF inside a frame")
    return orjson.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def send_frame(fd: int, obj) -> None:
    """Write ``obj`` as one frame to ``fd`` (raises OSError, e.g. BrokenPipeError, when the reader is gone)."""
    body = orjson.dumps(obj)
    write_all(fd, struct.pack(">I", len(body)) + body)


def write_all(fd: int, data) -> None:
    """Write all of the bytes-like ``data`` to the blocking ``fd``. Raises OSError."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
