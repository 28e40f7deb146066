"""Weight records (flywheel.weights): the announcement of a policy version, its tensor manifest and, for a
LoRA version, its adapter settings.
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas.base import Record


class TensorInfo(BaseModel):
    """One entry of a weight manifest."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    name: str
    shape: list[int]
    dtype: str


class AdapterInfo(BaseModel):
    """A policy version published as a LoRA adapter over the frozen base model (``trainer.lora``,
    ``shared/lora.py``): each module's weight is W + (alpha / r) · B A."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    kind: Literal["lora"] = "lora"
    r: int = Field(ge=1, le=4096)
    """Rank of every adapter."""
    alpha: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    """LoRA's alpha: the update is scaled by alpha / r."""
    target_modules: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(min_length=1, max_length=100_000)
    """Paths of the adapted linear modules in the base model (``model.layers.0.self_attn.q_proj``...)."""

    @property
    def scale(self) -> float:
        """alpha / r, the factor of B A."""
        return self.alpha / self.r


class WeightUpdate(Record):
    """flywheel.weights, key model name. Producer: trainer. Consumers: rollout (every replica), scheduler."""

    SCHEMA: ClassVar[str] = "flywheel.WeightUpdate"
    model: str
    version: int = Field(ge=0, le=2**53)
    step: int = Field(ge=0, le=2**53)
    transport: Literal["checkpoint", "distributed"] = "checkpoint"
    path: str | None = None
    """Safetensors file of this version in the checkpoint store (transport ``checkpoint``)."""
    manifest: list[TensorInfo]
    checksum: str
    """``<algorithm>:<hex>`` of the safetensors file: ``xxh3_128`` (what the trainer writes) or ``sha256`` (older records)
    (``shared.checkpoint.CHECKSUMS``)."""
    receivers: list[str] = Field(default_factory=list, max_length=4096)
    """Transport ``distributed``: the rollout engines in this version's broadcast session (the others,
    and any whose session fails, load the safetensors file)."""
    adapter: AdapterInfo | None = None
    """Set when the version is a LoRA adapter (``path`` then names its ``adapter_model.safetensors``, in peft's
    layout); None: ``path`` holds the full weights."""
    created_at: float = Field(default_factory=time.time)
