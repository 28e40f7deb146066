"""The checkpoint store: weights per policy version (safetensors) plus the trainer's state.

Layout under ``run.checkpoint_dir``::

    v000003/model.safetensors    weights of policy version 3 (what rollout engines load), or with
                                 trainer.lora adapter_model.safetensors, its LoRA adapters (shared/lora.py)
    v000003/update.json          its WeightUpdate record (the version is published once this exists)
    v000003/trained_groups.json  ids of the groups trained in the step that made this version
    v000003/optimizer.pt         AdamW moments (the bulk: twice the weights)
    v000003/trainer_state.pt     LR schedule, RNG, step, version, ids of every group trained so far
                                 (written last: its presence makes the version complete)
    latest.json                  the WeightUpdate record of the newest *complete* version

A version is saved in two phases so that announcing it does not wait for the optimizer state
(~1.1 GB for SmolLM2, ~1.5 s to write here): :meth:`CheckpointStore.save_weights` writes the first
three files into a temporary directory and renames it (atomic: the version exists whole or not at
all), then :meth:`CheckpointStore.save_trainer_state` adds ``optimizer.pt`` and ``trainer_state.pt``
(each written to a ``.tmp`` file and renamed) and moves ``latest.json``. A crash between the two leaves
one published version without trainer state; the trainer resumes at it with the previous version's
optimizer state (see ``trainer_service.main.build_trainer``). A write that fails (a full disk:
:class:`shared.disk.DiskFullError`) removes its partial files, so ``latest.json`` and ``newest_published`` never
name a half-written version.

What is kept (:meth:`CheckpointStore.prune`), and why: resume needs the newest complete version's
weights and trainer state, plus the optimizer state of that version (the fallback for a newer
published version that lacks its state is that same complete version); rollout engines that lag may
still load the weights of a few older versions. So the newest ``keep`` versions keep their weights, and
only the newest complete version keeps ``optimizer.pt`` and ``trainer_state.pt``: ``keep`` × weights +
1 × optimizer state instead of ``keep`` × (weights + optimizer state). A finished run can drop the last
optimizer state too (``trainer.drop_optimizer_on_finish``, or ``flywheel clean``). Files written before
this layout (the optimizer inside ``trainer_state.pt``) still load.

``optimizer.pt`` is written with direct I/O (:class:`shared.disk.DirectFile`): a file that only resume reads
has no business in the page cache, and on this machine's virtual disk buffered writes of ~1.6 GB per step
cost the machine 1.6-2.0 CPU-seconds per step (mostly kernel time: page-cache allocation, reclaim and
writeback) against 0.6-0.9 with the optimizer state through ``O_DIRECT`` (``benchmarks/checkpoint_io.py``). The weights stay buffered: the rollout engines
read them right after, from the cache.

Disk space and the direct-I/O writer live in :mod:`shared.disk`; taking a model's weights for a version and
loading them back, in :mod:`shared.model_weights`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import xxhash

try:  # imported here: torch.save imports it lazily, so before the first save the setting is not there to set
    from torch.utils.serialization import config as _torch_serialization
    _TORCH_SAVE = _torch_serialization.save if hasattr(_torch_serialization.save, "compute_crc32") else None
except ImportError:  # a torch without the setting: _torch_crc32 is a no-op
    _TORCH_SAVE = None
from safetensors.torch import load_file, save_file

from shared.disk import DirectFile, DiskFullError, is_disk_full
from shared.schemas import AdapterInfo, TensorInfo, WeightUpdate, decode

WEIGHTS_FILE = "model.safetensors"
"""A version's full weights."""
ADAPTER_FILE = "adapter_model.safetensors"
"""A LoRA version's adapters (``trainer.lora``; ``shared/lora.py``), in peft's layout."""
T = TypeVar("T")

CHECKSUMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Checksum algorithms by the prefix of ``WeightUpdate.checksum`` (``<algorithm>:<hex>``). Weights are written with
``xxh3_128`` (about 14x faster than sha256 here: the check is on the critical path of every
step, written by the trainer and verified by each rollout engine); ``sha256`` records still verify. Neither is
a signature: the checksum catches a torn or corrupted file; who may write the checkpoint store is the access
control (docs/security.md)."""


def file_checksum(path: str | os.PathLike, algorithm: str = "xxh3_128") -> str:
    """``<algorithm>:<hex>`` of a file (read in 8 MiB chunks), ``algorithm`` a key of :data:`CHECKSUMS`.

    Raises:
        ValueError: the algorithm is not one of :data:`CHECKSUMS`.
    """
    if algorithm not in CHECKSUMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {sorted(CHECKSUMS)})")
    h = CHECKSUMS[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return f"{algorithm}:{h.hexdigest()}"


@contextmanager
def _torch_crc32(enabled: bool):
    """Within the block, ``torch.save`` computes its zip records' CRC-32 or not (torch's process-wide
    ``torch.utils.serialization.config.save.compute_crc32``; restored after). A torch without it: no-op."""
    if _TORCH_SAVE is None:
        yield
        return
    before = _TORCH_SAVE.compute_crc32
    _TORCH_SAVE.compute_crc32 = enabled
    try:
        yield
    finally:
        _TORCH_SAVE.compute_crc32 = before


def _write_guarded(path: Path, write: Callable[[], T], cleanup: Callable[[], None]) -> T:
    """Run ``write`` and return its result; on any failure run ``cleanup`` and raise :class:`DiskFullError`
    for a full disk, else re-raise."""
    try:
        return write()
    except BaseException as e:
        cleanup()
        if is_disk_full(e):
            raise DiskFullError(path, e) from e
        raise


def manifest(weights: dict[str, torch.Tensor]) -> list[TensorInfo]:
    """Name, shape and dtype of every tensor in a state dict."""
    return [TensorInfo(name=k, shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."))
            for k, v in weights.items()]


class CheckpointStore:
    """A directory of policy versions (see module docstring)."""

    def __init__(self, root: str | os.PathLike, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def save_weights(self, weights: dict[str, torch.Tensor], model_name: str, version: int, step: int,
                     trained_groups: list[str] | None = None, adapter: AdapterInfo | None = None) -> WeightUpdate:
        """Phase 1: write the weights (from :func:`shared.model_weights.snapshot_weights`) of ``version``; returns
        its WeightUpdate.

        Everything is written into ``vNNNNNN.tmp`` and renamed, so ``update.json`` never points at a
        partial file. ``trained_groups`` are the ids of the groups this step trained. With ``adapter``,
        ``weights`` are LoRA adapters (``shared.lora.adapter_state``), written to ``adapter_model.safetensors``.

        Raises:
            DiskFullError: the file system is full; the temporary directory was removed.
        """
        d = self.version_dir(version)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)

        def write() -> WeightUpdate:
            tmp.mkdir(parents=True)
            name = ADAPTER_FILE if adapter is not None else WEIGHTS_FILE
            save_file(weights, str(tmp / name))
            update = WeightUpdate(model=model_name, version=version, step=step, transport="checkpoint",
                                  path=str(d / name), manifest=manifest(weights),
                                  checksum=file_checksum(tmp / name), adapter=adapter)
            (tmp / "update.json").write_bytes(update.encode())
            (tmp / "trained_groups.json").write_text(json.dumps(sorted(trained_groups or [])))
            return update

        update = _write_guarded(tmp, write, lambda: shutil.rmtree(tmp, ignore_errors=True))
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        return update

    def save_trainer_state(self, update: WeightUpdate, trainer_state: dict) -> None:
        """Phase 2: add the trainer state to a version written by :meth:`save_weights`; it becomes ``latest``.

        ``trainer_state["optimizer"]`` goes to ``optimizer.pt`` (``None``: no optimizer state is kept, e.g.
        at the end of a finished run with ``trainer.drop_optimizer_on_finish``), the rest to
        ``trainer_state.pt``, written last, with the optimizer file's checksum (``optimizer_checksum``,
        verified by :meth:`load_trainer_state`); then ``latest.json`` moves and :meth:`prune` runs.

        Raises:
            DiskFullError: the file system is full; the partial files were removed and ``latest`` is unchanged.
        """
        d = self.version_dir(update.version)
        optimizer = trainer_state.get("optimizer")
        rest = {k: v for k, v in trainer_state.items() if k != "optimizer" or v is None}
        if optimizer is not None:
            rest["optimizer_checksum"] = self._save_torch(optimizer, d / "optimizer.pt", direct=True)
        else:
            (d / "optimizer.pt").unlink(missing_ok=True)
        self._save_torch(rest, d / "trainer_state.pt")
        self._set_latest(update)
        self.prune()

    @staticmethod
    def _save_torch(obj: Any, path: Path, direct: bool = False) -> str | None:
        """``torch.save`` to ``path.tmp`` through a file object (so a full disk is an ``OSError``), then rename.
        ``direct``: through a :class:`DirectFile` (past the page cache, and ``fsync`` ed), without torch's
        per-record CRC-32 (which ``torch.load`` never checks: a flipped byte loads silently; ~0.2 s per GB),
        returning the file's xxh3-128 checksum instead (None without ``direct``).

        Raises:
            DiskFullError: the file system is full (the ``.tmp`` file was removed).
        """
        tmp = path.with_name(path.name + ".tmp")

        def write() -> str | None:
            if not direct:
                with open(tmp, "wb") as f:
                    torch.save(obj, f)
                return None
            with DirectFile(tmp) as f, _torch_crc32(False):
                torch.save(obj, f)
            return f.checksum

        checksum = _write_guarded(tmp, write, lambda: tmp.unlink(missing_ok=True))
        os.replace(tmp, path)
        return checksum

    def save(self, weights: dict[str, torch.Tensor], model_name: str, version: int, step: int,
             trainer_state: dict | None, trained_groups: list[str] | None = None,
             adapter: AdapterInfo | None = None) -> WeightUpdate:
        """Both phases at once (``trainer_state`` None: weights only, e.g. a base model for rollout tests)."""
        update = self.save_weights(weights, model_name, version, step, trained_groups, adapter)
        if trainer_state is not None:
            self.save_trainer_state(update, trainer_state)
        else:
            self._set_latest(update)
        return update

    def _set_latest(self, update: WeightUpdate) -> None:
        """Point ``latest.json`` at ``update`` (atomic replace).

        Raises:
            DiskFullError: the file system is full (``latest.json`` is unchanged).
        """
        tmp = self.root / "latest.json.tmp"
        _write_guarded(tmp, lambda: tmp.write_bytes(update.encode()), lambda: tmp.unlink(missing_ok=True))
        os.replace(tmp, self.root / "latest.json")

    def latest(self) -> WeightUpdate | None:
        """The newest complete version's WeightUpdate (weights and trainer state), or None."""
        p = self.root / "latest.json"
        return decode(p.read_bytes(), WeightUpdate) if p.exists() else None

    def newest_published(self) -> WeightUpdate | None:
        """The newest version whose weights are complete (with or without trainer state), or None."""
        for d in sorted(self.root.glob("v*"), reverse=True):
            if d.is_dir() and not d.name.endswith(".tmp") and (d / "update.json").exists():
                return decode((d / "update.json").read_bytes(), WeightUpdate)
        return self.latest()

    def trained_groups(self, version: int) -> set[str]:
        """Ids of the groups trained in the step that made ``version`` (empty when unknown)."""
        p = self.version_dir(version) / "trained_groups.json"
        return set(json.loads(p.read_text())) if p.exists() else set()

    def load_trainer_state(self, version: int) -> dict | None:
        """The trainer state of ``version`` with its ``optimizer`` (from ``optimizer.pt``; ``None`` when it was
        dropped), or None when the version has no ``trainer_state.pt``.

        Raises:
            ValueError: ``optimizer.pt`` does not match the checksum recorded when it was written.
        """
        d = self.version_dir(version)
        if not (d / "trainer_state.pt").exists():
            return None
        state = torch.load(d / "trainer_state.pt", weights_only=False)
        want = state.pop("optimizer_checksum", None)
        if "optimizer" not in state and (d / "optimizer.pt").exists():
            if want is not None and (got := file_checksum(d / "optimizer.pt", want.partition(":")[0])) != want:
                raise ValueError(f"{d / 'optimizer.pt'}: checksum {got} != {want} recorded when it was written: the "
                                 "optimizer state is corrupt (resuming from it would train on wrong moments)")
            state["optimizer"] = torch.load(d / "optimizer.pt", weights_only=False)
        return state

    def versions(self) -> list[int]:
        """Versions whose directory is complete enough to be published (``update.json`` present), oldest first."""
        return sorted(int(p.name[1:]) for p in self.root.glob("v*")
                      if p.is_dir() and not p.name.endswith(".tmp") and p.name[1:].isdigit()
                      and (p / "update.json").exists())

    def version_bytes(self, version: int) -> int:
        """Bytes of the files of ``version`` on disk (0 when absent)."""
        d = self.version_dir(version)
        return sum(f.stat().st_size for f in d.iterdir() if f.is_file()) if d.is_dir() else 0

    def free_bytes(self) -> int:
        """Free bytes (for an unprivileged user) on the store's file system (:func:`shutil.disk_usage`)."""
        return shutil.disk_usage(self.root).free

    def remove_partial(self) -> list[Path]:
        """Delete what an interrupted write left (``*.tmp`` directories and files); returns what went.

        Only the store's writer (the trainer, before its first save) may call this: a reader would delete
        a write in progress.
        """
        gone = sorted(self.root.glob("*.tmp")) + sorted(self.root.glob("v*/*.tmp"))
        for p in gone:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return gone

    def prune(self) -> None:
        """Delete all but the newest ``keep`` version directories (never the newest complete one, ``latest``),
        then the trainer and optimizer state of every version older than ``latest``: resume reads only
        ``latest``'s (see the module docstring); their weights stay for rollout engines that lag."""
        latest = self.latest()
        dirs = sorted(p for p in self.root.glob("v*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in dirs[: -self.keep]:
            if latest is None or old != self.version_dir(latest.version):
                shutil.rmtree(old, ignore_errors=True)
        if latest is None:
            return
        for v in self.versions():
            if v < latest.version:
                for name in ("optimizer.pt", "trainer_state.pt"):
                    (self.version_dir(v) / name).unlink(missing_ok=True)


def read_update(update: WeightUpdate, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of the file a WeightUpdate points to (full weights, or a LoRA adapter), its checksum checked.

    Raises:
        FileNotFoundError: the version was pruned or never written.
        ValueError: the record has no path, or the file's checksum differs from the record's or names an
            unknown algorithm.
    """
    if update.path is None:
        raise ValueError(f"weight version {update.version} has no checkpoint path")
    if verify:
        got = file_checksum(update.path, update.checksum.partition(":")[0])
        if got != update.checksum:
            raise ValueError(f"weight version {update.version}: checksum {got} != {update.checksum}")
    return load_file(str(update.path))
