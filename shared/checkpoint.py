"""The checkpoint store: weights per policy version (safetensors) plus the trainer's full state.

Layout under ``run.checkpoint_dir``::

    v000003/model.safetensors    weights of policy version 3 (what rollout engines load)
    v000003/update.json          its WeightUpdate record (the version is published once this exists)
    v000003/trained_groups.json  ids of the groups trained in the step that made this version
    v000003/trainer_state.pt     optimizer, RNG, step, version, ids of every group trained so far
    latest.json                  the WeightUpdate record of the newest *complete* version

A version is saved in two phases so that announcing it does not wait for the optimizer state
(~1.1 GB for SmolLM2, ~1.5 s to write here): :meth:`CheckpointStore.save_weights` writes the first
three files into a temporary directory and renames it (atomic: the version exists whole or not at
all), then :meth:`CheckpointStore.save_trainer_state` adds ``trainer_state.pt`` and moves
``latest.json``. A crash between the two leaves one published version without trainer state; the
trainer resumes at it with the previous version's optimizer state (see
``trainer_service.main.build_trainer``). Only the newest ``keep`` versions are kept.
"""

from __future__ import annotations

import hashlib
import json
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

    def save_weights(self, weights: dict[str, torch.Tensor], model_name: str, version: int, step: int,
                     trained_groups: list[str] | None = None) -> WeightUpdate:
        """Phase 1: write the weights (from :func:`snapshot_weights`) of ``version``; returns its WeightUpdate.

        Everything is written into ``vNNNNNN.tmp`` and renamed, so ``update.json`` never points at a
        partial file. ``trained_groups`` are the ids of the groups this step trained.
        """
        d = self.version_dir(version)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(weights, str(tmp / "model.safetensors"))
        update = WeightUpdate(model=model_name, version=version, step=step, transport="checkpoint",
                              path=str(d / "model.safetensors"), manifest=manifest(weights),
                              checksum=file_sha256(tmp / "model.safetensors"))
        (tmp / "update.json").write_bytes(update.encode())
        (tmp / "trained_groups.json").write_text(json.dumps(sorted(trained_groups or [])))
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        return update

    def save_trainer_state(self, update: WeightUpdate, trainer_state: dict) -> None:
        """Phase 2: add the trainer state to a version written by :meth:`save_weights`; it becomes ``latest``."""
        d = self.version_dir(update.version)
        torch.save(trainer_state, d / "trainer_state.pt.tmp")
        os.replace(d / "trainer_state.pt.tmp", d / "trainer_state.pt")
        self._set_latest(update)
        self.prune()

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
        """Point ``latest.json`` at ``update`` (atomic replace)."""
        tmp = self.root / "latest.json.tmp"
        tmp.write_bytes(update.encode())
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
