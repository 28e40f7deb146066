"""The checkpoint store: weights per policy version (safetensors) plus the trainer's full state.

Layout under ``run.checkpoint_dir``::

    v000003/model.safetensors    weights of policy version 3 (what rollout engines load)
    v000003/trainer_state.pt     optimizer, RNG, step, version, ids of groups already trained
    latest.json                  the WeightUpdate record of the newest complete version

``latest.json`` is replaced atomically after both files are written, so a crash mid-save leaves
the previous version as the latest. Only the newest ``keep`` versions are kept.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.schemas import TensorInfo, WeightUpdate, decode


def file_sha256(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of a file (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


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

    def save(self, weights: dict[str, torch.Tensor], model_name: str, version: int, step: int,
             trainer_state: dict | None) -> WeightUpdate:
        """Write weights (from :func:`snapshot_weights`) and the trainer state of ``version``.

        ``latest.json`` moves to this version only once both files are complete. Returns its WeightUpdate.
        """
        d = self.version_dir(version)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(weights, str(tmp / "model.safetensors"))
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        update = WeightUpdate(model=model_name, version=version, step=step, transport="checkpoint",
                              path=str(d / "model.safetensors"), manifest=manifest(weights),
                              checksum=file_sha256(d / "model.safetensors"))
        latest_tmp = self.root / "latest.json.tmp"
        latest_tmp.write_bytes(update.encode())
        os.replace(latest_tmp, self.root / "latest.json")
        self.prune()
        return update

    def latest(self) -> WeightUpdate | None:
        """The newest complete version's WeightUpdate, or None for an empty store."""
        p = self.root / "latest.json"
        return decode(p.read_bytes(), WeightUpdate) if p.exists() else None

    def load_trainer_state(self, version: int) -> dict | None:
        p = self.version_dir(version) / "trainer_state.pt"
        return torch.load(p, weights_only=False) if p.exists() else None

    def prune(self) -> None:
        """Delete all but the newest ``keep`` version directories."""
        dirs = sorted(p for p in self.root.glob("v*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_weights(model: torch.nn.Module, update: WeightUpdate, verify: bool = True) -> None:
    """Load the weights a WeightUpdate points to into ``model``.

    Raises:
        FileNotFoundError: the version was pruned or never written.
        ValueError: the file's checksum differs from the record's.
    """
    if update.path is None:
        raise ValueError(f"weight version {update.version} has no checkpoint path")
    if verify:
        got = file_sha256(update.path)
        if got != update.checksum:
            raise ValueError(f"weight version {update.version}: checksum {got} != {update.checksum}")
    load_weights_file(model, update.path)


def load_weights_file(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a safetensors file written by :meth:`CheckpointStore.save` into ``model`` in place.

    Raises:
        ValueError: a tensor is missing (other than one tied to a loaded tensor) or unexpected.
    """
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {unexpected[:5]}")
    loaded = {model.state_dict()[k].untyped_storage().data_ptr() for k in state}
    untied = [k for k in missing if model.state_dict()[k].untyped_storage().data_ptr() not in loaded]
    if untied:
        raise ValueError(f"{path}: missing tensors {untied[:5]}")
