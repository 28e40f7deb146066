"""A model's weights as state dicts: the copy (or the live tensors) a policy version publishes, with tied
tensors stored once, and loading a published version's weights back into a model in place.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from shared.checkpoint import read_update
from shared.schemas import WeightUpdate


def snapshot_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the model's state dict with tied tensors stored once (first name kept)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in _untied(model)}


def _untied(model: torch.nn.Module):
    """``(name, tensor)`` of the model's state dict with tied tensors once (the first name kept)."""
    seen = set()
    for k, v in model.state_dict().items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if ptr not in seen:
            seen.add(ptr)
            yield k, v


def live_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's CPU state dict as :func:`snapshot_weights` lays it out (tied tensors once), without copying:
    the tensors are the parameters themselves, so they must not change until whoever reads them is done
    (``trainer_service.trainer.PolicyTrainer.update_gate``).

    Raises:
        ValueError: a tensor is not on the CPU or not contiguous (safetensors writes neither in place).
    """
    out = {}
    for k, v in _untied(model):
        if v.device.type != "cpu" or not v.is_contiguous():
            raise ValueError(f"{k}: live weights need contiguous CPU tensors (use snapshot_weights)")
        out[k] = v.detach()
    return out


def load_weights(model: torch.nn.Module, update: WeightUpdate, verify: bool = True) -> None:
    """Load the full weights a WeightUpdate points to into ``model``.

    Raises:
        FileNotFoundError: the version was pruned or never written.
        ValueError: the version is a LoRA adapter (:class:`shared.lora.AdapterApplier` serves those), or as
            :func:`shared.checkpoint.read_update`.
    """
    if update.adapter is not None:
        raise ValueError(f"weight version {update.version} is a LoRA adapter, not full weights")
    load_weights_state(model, read_update(update, verify), str(update.path))


def load_weights_file(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a safetensors file written by :meth:`shared.checkpoint.CheckpointStore.save` into ``model`` in place.

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
    if not missing:
        return
    own = model.state_dict()  # once: building it walks every module (~1 ms for SmolLM2; it was built per tensor)
    loaded = {own[k].untyped_storage().data_ptr() for k in state}
    untied = [k for k in missing if own[k].untyped_storage().data_ptr() not in loaded]
    if untied:
        raise ValueError(f"{origin}: missing tensors {untied[:5]}")
