"""The checkpoint store: weights per policy version (safetensors) plus the trainer's state.

Layout under ``run.checkpoint_dir``::

    v000003/model.safetensors    weights of policy version 3 (what rollout engines load)
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
:class:`DiskFullError`) removes its partial files, so ``latest.json`` and ``newest_published`` never
name a half-written version.

What is kept (:meth:`CheckpointStore.prune`), and why: resume needs the newest complete version's
weights and trainer state, plus the optimizer state of that version (the fallback for a newer
published version that lacks its state is that same complete version); rollout engines that lag may
still load the weights of a few older versions. So the newest ``keep`` versions keep their weights, and
only the newest complete version keeps ``optimizer.pt`` and ``trainer_state.pt``: ``keep`` × weights +
1 × optimizer state instead of ``keep`` × (weights + optimizer state). A finished run can drop the last
optimizer state too (``trainer.drop_optimizer_on_finish``, or ``flywheel clean``). Files written before
this layout (the optimizer inside ``trainer_state.pt``) still load.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import xxhash
from safetensors.torch import load_file, save_file

from shared.schemas import TensorInfo, WeightUpdate, decode


CHECKSUMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Checksum algorithms by the prefix of ``WeightUpdate.checksum`` (``<algorithm>:<hex>``). Weights are written with
``xxh3_128`` since issue 20 (about 14x faster than sha256 here: the check is on the critical path of every
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


class DiskFullError(OSError):
    """A checkpoint file could not be written because its file system is full (ENOSPC or EDQUOT).

    Raised by :meth:`CheckpointStore.save_weights` and :meth:`CheckpointStore.save_trainer_state` after
    they removed what they had written, so the store is as it was before the call."""

    def __init__(self, path: str | os.PathLike, cause: BaseException) -> None:
        super().__init__(errno.ENOSPC, f"no space left to write {path}: {cause}")


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a full disk.

    The writers report it differently: ``OSError(ENOSPC)`` from Python file objects, safetensors'
    ``SafetensorError("... No space left on device (os error 28)")``, torch.save to a path a bare
    ``RuntimeError`` (hence :meth:`CheckpointStore.save_trainer_state` writes through a file object).
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


def _write_guarded(path: Path, write: Callable[[], None], cleanup: Callable[[], None]) -> None:
    """Run ``write``; on any failure run ``cleanup`` and raise :class:`DiskFullError` for a full disk,
    else re-raise."""
    try:
        write()
    except BaseException as e:
        cleanup()
        if is_disk_full(e):
            raise DiskFullError(path, e) from e
        raise


def manifest(weights: dict[str, torch.Tensor]) -> list[TensorInfo]:
    """Name, shape and dtype of every tensor in a state dict."""
    return [TensorInfo(name=k, shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."))
            for k, v in weights.items()]


def snapshot_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the model's state dict with tied tensors stored once (first name kept)."""
    out, seen = {}, set()
    for k, v in model.state_dict().items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        out[k] = v.detach().to("cpu", copy=True).contiguous()
    return out


class CheckpointStore:
    """A directory of policy versions (see module docstring)."""

    def __init__(self, root: str | os.PathLike, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def save_weights(self, weights: dict[str, torch.Tensor], model_name: str, version: int, step: int,
                     trained_groups: list[str] | None = None) -> WeightUpdate:
        """Phase 1: write the weights (from :func:`snapshot_weights`) of ``version``; returns its WeightUpdate.

        Everything is written into ``vNNNNNN.tmp`` and renamed, so ``update.json`` never points at a
        partial file. ``trained_groups`` are the ids of the groups this step trained.

        Raises:
            DiskFullError: the file system is full; the temporary directory was removed.
        """
        d = self.version_dir(version)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        out: list[WeightUpdate] = []

        def write() -> None:
            tmp.mkdir(parents=True)
            save_file(weights, str(tmp / "model.safetensors"))
            out.append(WeightUpdate(model=model_name, version=version, step=step, transport="checkpoint",
                                    path=str(d / "model.safetensors"), manifest=manifest(weights),
                                    checksum=file_checksum(tmp / "model.safetensors")))
            (tmp / "update.json").write_bytes(out[0].encode())
            (tmp / "trained_groups.json").write_text(json.dumps(sorted(trained_groups or [])))

        _write_guarded(tmp, write, lambda: shutil.rmtree(tmp, ignore_errors=True))
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        return out[0]

    def save_trainer_state(self, update: WeightUpdate, trainer_state: dict) -> None:
        """Phase 2: add the trainer state to a version written by :meth:`save_weights`; it becomes ``latest``.

        ``trainer_state["optimizer"]`` goes to ``optimizer.pt`` (``None``: no optimizer state is kept, e.g.
        at the end of a finished run with ``trainer.drop_optimizer_on_finish``), the rest to
        ``trainer_state.pt``, written last; then ``latest.json`` moves and :meth:`prune` runs.

        Raises:
            DiskFullError: the file system is full; the partial files were removed and ``latest`` is unchanged.
        """
        d = self.version_dir(update.version)
        optimizer = trainer_state.get("optimizer")
        rest = {k: v for k, v in trainer_state.items() if k != "optimizer" or v is None}
        if optimizer is not None:
            self._save_torch(optimizer, d / "optimizer.pt")
        else:
            (d / "optimizer.pt").unlink(missing_ok=True)
        self._save_torch(rest, d / "trainer_state.pt")
        self._set_latest(update)
        self.prune()

    @staticmethod
    def _save_torch(obj: Any, path: Path) -> None:
        """``torch.save`` to ``path.tmp`` through a file object (so a full disk is an ``OSError``), then rename.

        Raises:
            DiskFullError: the file system is full (the ``.tmp`` file was removed).
        """
        tmp = path.with_name(path.name + ".tmp")

        def write() -> None:
            with open(tmp, "wb") as f:
                torch.save(obj, f)

        _write_guarded(tmp, write, lambda: tmp.unlink(missing_ok=True))
        os.replace(tmp, path)

    def save(self, weights: dict[str, torch.Tensor], model_name: str, version: int, step: int,
             trainer_state: dict | None, trained_groups: list[str] | None = None) -> WeightUpdate:
        """Both phases at once (``trainer_state`` None: weights only, e.g. a base model for rollout tests)."""
        update = self.save_weights(weights, model_name, version, step, trained_groups)
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
        dropped), or None when the version has no ``trainer_state.pt``."""
        d = self.version_dir(version)
        if not (d / "trainer_state.pt").exists():
            return None
        state = torch.load(d / "trainer_state.pt", weights_only=False)
        if "optimizer" not in state and (d / "optimizer.pt").exists():
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


def load_weights(model: torch.nn.Module, update: WeightUpdate, verify: bool = True) -> None:
    """Load the weights a WeightUpdate points to into ``model``.

    Raises:
        FileNotFoundError: the version was pruned or never written.
        ValueError: the file's checksum differs from the record's, or names an unknown algorithm.
    """
    if update.path is None:
        raise ValueError(f"weight version {update.version} has no checkpoint path")
    if verify:
        got = file_checksum(update.path, update.checksum.partition(":")[0])
        if got != update.checksum:
            raise ValueError(f"weight version {update.version}: checksum {got} != {update.checksum}")
    load_weights_file(model, update.path)


def load_weights_file(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a safetensors file written by :meth:`CheckpointStore.save` into ``model`` in place.

    Raises:
        ValueError: a tensor is missing (other than one tied to a loaded tensor) or unexpected.
    """
    load_weights_state(model, load_file(str(path)), str(path))


def load_weights_state(model: torch.nn.Module, state: dict[str, torch.Tensor], origin: str = "weights") -> None:
    """Load ``state`` (tied tensors stored once, as :func:`snapshot_weights` makes it) into ``model`` in place.

    Raises:
        ValueError: a tensor is missing (other than one tied to a loaded tensor) or unexpected.
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{origin}: unexpected tensors {unexpected[:5]}")
    loaded = {model.state_dict()[k].untyped_storage().data_ptr() for k in state}
    untied = [k for k in missing if model.state_dict()[k].untyped_storage().data_ptr() not in loaded]
    if untied:
        raise ValueError(f"{origin}: missing tensors {untied[:5]}")
