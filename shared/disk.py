"""Disk space and disk writes of the checkpoint store: what a full disk looks like, how many bytes a version
takes, when one may be written (:class:`DiskPolicy`), and the direct-I/O writer of the optimizer state
(:class:`DirectFile`), which keeps a file that only resume reads out of the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xxhash

log = logging.getLogger("checkpoint")


class DiskFullError(OSError):
    """A checkpoint file could not be written because its file system is full (ENOSPC or EDQUOT).

    Raised by :meth:`shared.checkpoint.CheckpointStore.save_weights` and
    :meth:`shared.checkpoint.CheckpointStore.save_trainer_state` after they removed what they had written, so the
    store is as it was before the call."""

    def __init__(self, path: str | os.PathLike, cause: BaseException) -> None:
        super().__init__(errno.ENOSPC, f"no space left to write {path}: {cause}")


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a full disk.

    The writers report it differently: ``OSError(ENOSPC)`` from Python file objects, safetensors'
    ``SafetensorError("... No space left on device (os error 28)")``, torch.save to a path a bare
    ``RuntimeError`` (hence :meth:`shared.checkpoint.CheckpointStore.save_trainer_state` writes through a file
    object).
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(t in str(e) for t in _FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor nested in ``obj`` (dicts, lists, tuples), each counted once."""
    seen: set[int] = set()

    def walk(o: Any) -> int:
        if isinstance(o, torch.Tensor):
            key = o.untyped_storage().data_ptr()
            if key in seen and key != 0:
                return 0
            seen.add(key)
            return o.numel() * o.element_size()
        if isinstance(o, dict):
            return sum(walk(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(walk(v) for v in o)
        return 0

    return walk(obj)


CHECKPOINT_OVERHEAD_BYTES = 1 << 20
"""Added to the tensors' bytes in :func:`checkpoint_bytes`: safetensors header, the JSON files, the pickled
RNG state and counters (a few KiB for the tiny model; 1 MiB keeps a margin)."""


def checkpoint_bytes(weights: dict[str, torch.Tensor], trainer_state: dict | None) -> int:
    """Expected bytes on disk of one version: its tensors, ~64 B per group id, :data:`CHECKPOINT_OVERHEAD_BYTES`."""
    ids = len(trainer_state.get("done_groups", ())) if trainer_state else 0
    return tensor_bytes(weights) + tensor_bytes(trainer_state) + 64 * ids + CHECKPOINT_OVERHEAD_BYTES


DiskLevel = Literal["ok", "warning", "critical"]


@dataclass(frozen=True)
class DiskPolicy:
    """When a checkpoint may be written, and when to warn (``trainer.disk_*``).

    ``reserve_bytes``: what must stay free after the write (logs, the registry, other processes).
    ``warn_checkpoints``: warn while fewer than this many more checkpoints would fit above the reserve.
    """

    reserve_bytes: int
    warn_checkpoints: float

    def level(self, free: int, need: int) -> DiskLevel:
        """``critical``: writing ``need`` bytes would leave less than the reserve of ``free`` bytes (do not
        write); ``warning``: fewer than ``warn_checkpoints`` × ``need`` above the reserve; else ``ok``."""
        if free - need < self.reserve_bytes:
            return "critical"
        if free < self.reserve_bytes + self.warn_checkpoints * need:
            return "warning"
        return "ok"

    def threshold(self, level: DiskLevel, need: int) -> int:
        """The free bytes below which ``level`` holds (for the alert's ``threshold``)."""
        if level == "critical":
            return self.reserve_bytes + need
        return int(self.reserve_bytes + self.warn_checkpoints * need)


class DirectFile(io.RawIOBase):
    """A write-only file that bypasses the page cache (``O_DIRECT``), for large files read back rarely.

    Bytes given to :meth:`write` are copied into a page-aligned staging buffer of ``stage_bytes`` (an
    anonymous ``mmap``) and written a full buffer at a time; :meth:`close` writes the last partial buffer
    padded to :data:`BLOCK` bytes, truncates the file to the bytes written, and ``fsync`` s it (so a file that
    closed without error is on disk). ``O_DIRECT`` needs the memory, offset and length of every write aligned
    to the device's logical block size; 4,096 covers every block device in use, and the staging buffer keeps
    callers free of that rule (``torch.save`` writes through it as through any file object).

    A file system that refuses ``O_DIRECT`` (``EINVAL`` at open) gets an ordinary buffered file, flushed and
    ``fsync`` ed at close the same way (logged once per process). :attr:`checksum` is the xxh3-128 of what was
    written, computed on the way (~0.1 s per GB), so a reader can verify the file without this writer's help.

    Args:
        path: created or truncated, mode 0600.
        stage_bytes: size of the staging buffer in bytes (a multiple of :data:`BLOCK`; default 16 MiB).

    Raises:
        OSError: from ``open``/``write``/``fsync`` (``ENOSPC`` on a full disk: the caller removes the file).
    """

    BLOCK = 4096
    """Alignment (bytes) of the memory, file offset and length of every ``O_DIRECT`` write."""
    _warned = False

    def __init__(self, path: str | os.PathLike, stage_bytes: int = 16 << 20) -> None:
        super().__init__()
        if stage_bytes <= 0 or stage_bytes % self.BLOCK:
            raise ValueError(f"stage_bytes must be a positive multiple of {self.BLOCK}, not {stage_bytes}")
        self.size = 0
        """Bytes written so far (the file's length once closed)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o600)
            self._buffered(f"{path}: the file system refuses O_DIRECT at open")
        self._stage = mmap.mmap(-1, stage_bytes)
        self._view = memoryview(self._stage)
        self._fill = 0
        self._hash = xxhash.xxh3_128()

    def _buffered(self, why: str) -> None:
        """From now on this file goes through the page cache (logged once per process)."""
        self.direct = False
        if not DirectFile._warned:
            DirectFile._warned = True
            log.info("%s; writing through the page cache", why)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        """Append ``data`` (any bytes-like object); returns its length in bytes."""
        src = memoryview(data).cast("B")
        self._hash.update(src)
        n, i, cap = len(src), 0, len(self._stage)
        while i < n:
            c = min(cap - self._fill, n - i)
            self._view[self._fill:self._fill + c] = src[i:i + c]
            self._fill += c
            i += c
            if self._fill == cap:
                self._drain()
        self.size += n
        return n

    @property
    def checksum(self) -> str:
        """``xxh3_128:<hex>`` of the bytes written so far (:func:`shared.checkpoint.file_checksum` of the closed file)."""
        return f"xxh3_128:{self._hash.hexdigest()}"

    def _drain(self) -> None:
        """Write the staged bytes, padded with zeros to a whole block (only the last drain is partial).

        A file system that took ``O_DIRECT`` at open but refuses it on ``write`` (``EINVAL``: some FUSE and
        overlay mounts, devices with blocks over 4 KiB) gets the flag cleared and the write retried through the
        page cache. A write that stores nothing, or a short one that leaves the next misaligned, is reported as
        ``ENOSPC`` (what it means on a local file system), so the caller sees a full disk.
        """
        end = -(-self._fill // self.BLOCK) * self.BLOCK
        self._view[self._fill:end] = bytes(end - self._fill)
        done = 0
        while done < end:
            try:
                n = os.write(self._fd, self._view[done:end])
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self._buffered("a write with O_DIRECT was refused (EINVAL)")
                continue
            if n <= 0 or (self.direct and done + n < end and n % self.BLOCK):
                raise OSError(errno.ENOSPC, f"short write ({n} of {end - done} bytes)")
            done += n
        self._fill = 0

    def close(self) -> None:
        """Write what is staged, cut the padding off, ``fsync`` and close (idempotent).

        Raises:
            OSError: the last write, the truncation or the ``fsync`` failed (the descriptor is closed anyway).
        """
        if self.closed:
            return
        try:
            if self._fill:
                self._drain()
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._view.release()
            self._stage.close()
            super().close()
