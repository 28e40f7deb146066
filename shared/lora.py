"""LoRA adapters as Flywheel trains, publishes and serves them.

With ``trainer.lora`` the trainer trains low-rank adapters only (injected by peft into the base model; the base
weights are frozen, so they get no gradient and no AdamW state), each policy version's weights are the adapter,
and a rollout engine applies it to the base it loaded at start. An adapted linear module computes

    y = x Wᵀ + (alpha / r) · x Aᵀ Bᵀ,   A: [r, in], B: [out, r]

(Hu et al. 2021, "LoRA", eq. 3; peft's ``LoraLayer`` without rsLoRA). B starts at zero, so version 0 is the base
model. An engine serves the same function with one dense weight per module, W' = W + (alpha / r) · B A
(:class:`AdapterApplier`), recomputed from a kept copy of W at every version rather than updated in place, so
no rounding accumulates over versions.

A version's file is ``adapter_model.safetensors`` in peft's saved layout (``base_model.model.<module>.lora_A.weight``
and ``.lora_B.weight``, float32), so it loads in peft as it is; :func:`merge_weights` folds it into full weights.

Only the trainer imports peft (:func:`inject`); applying and merging need torch alone.
"""

from __future__ import annotations

from typing import Iterable

import torch

from shared.schemas import AdapterInfo

PREFIX = "base_model.model."
"""peft's prefix of a saved adapter's tensor names."""
ADAPTER_NAME = "default"
"""The one peft adapter the trainer injects."""


def tensor_names(module: str) -> tuple[str, str]:
    """The saved names of ``module``'s A and B."""
    return f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"


def inject(model: torch.nn.Module, r: int, alpha: float, target_modules: str | list[str],
           dropout: float = 0.0) -> AdapterInfo:
    """Add LoRA adapters to ``model`` in place (peft's ``inject_adapter_in_model``; the model stays a plain
    transformers model, its ``model`` body and ``lm_head`` where they were) and freeze everything else.

    ``target_modules``: ``"all-linear"`` (every linear layer but the output layer, peft's meaning) or module-name
    suffixes (``["q_proj", "v_proj"]``). Returns what a published version must say about the adapters.

    Raises:
        ValueError: no module of ``model`` matches ``target_modules``.
    """
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none", init_lora_weights=True,
                        target_modules=target_modules)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    targets = sorted(name for name, m in model.named_modules() if isinstance(m, LoraLayer))
    if not targets:
        raise ValueError(f"trainer.lora.target_modules {target_modules!r} matches no linear module of the model")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return AdapterInfo(r=r, alpha=float(alpha), target_modules=targets)


def _lora_layers(model: torch.nn.Module, modules: Iterable[str]):
    for name in modules:
        layer = model.get_submodule(name)
        yield name, layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight


def adapter_state(model: torch.nn.Module, info: AdapterInfo, copy: bool = False) -> dict[str, torch.Tensor]:
    """The adapters of a model :func:`inject` prepared, by their saved names: the live parameters (``copy``
    False: they must not change until the reader is done) or CPU copies."""
    out = {}
    for name, a, b in _lora_layers(model, info.target_modules):
        na, nb = tensor_names(name)
        out[na], out[nb] = (a.detach().cpu().clone(), b.detach().cpu().clone()) if copy else (a.detach(), b.detach())
    return out


def _pairs(state: dict[str, torch.Tensor], info: AdapterInfo, origin: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` of a saved adapter, every target present and nothing else.

    Raises:
        ValueError: a target's tensor is missing, a tensor is not one of the targets', or a pair's ranks differ
        from ``info.r``.
    """
    want = {n: m for m in info.target_modules for n in tensor_names(m)}
    if unexpected := sorted(set(state) - set(want)):
        raise ValueError(f"{origin}: unexpected tensors {unexpected[:5]}")
    if missing := sorted(set(want) - set(state)):
        raise ValueError(f"{origin}: missing adapter tensors {missing[:5]}")
    out = {}
    for m in info.target_modules:
        a, b = (state[n] for n in tensor_names(m))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != info.r or b.shape[1] != info.r:
            raise ValueError(f"{origin}: {m}: A {list(a.shape)} and B {list(b.shape)} are not rank {info.r}")
        out[m] = (a, b)
    return out


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], info: AdapterInfo,
                       origin: str = "adapter") -> None:
    """Copy a saved adapter into the adapters of a model :func:`inject` prepared (a trainer's resume).

    Raises:
        ValueError: the adapter does not fit the model (names, ranks or shapes).
    """
    pairs = _pairs(state, info, origin)
    with torch.no_grad():
        for name, a, b in _lora_layers(model, info.target_modules):
            sa, sb = pairs[name]
            if sa.shape != a.shape or sb.shape != b.shape:
                raise ValueError(f"{origin}: {name}: shapes {list(sa.shape)}, {list(sb.shape)} != the model's "
                                 f"{list(a.shape)}, {list(b.shape)}")
            a.copy_(sa)
            b.copy_(sb)


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """(alpha / r) · B A: ``[out, in]`` float32 from A ``[r, in]`` and B ``[out, r]``."""
    return (b.float() @ a.float()) * scale


class AdapterApplier:
    """Serves LoRA versions from one dense model: keeps a copy of each adapted module's base weight (the first
    time that module is adapted) and sets the weight to base + delta for every version.

    Memory: one extra copy of the adapted weights (``all-linear`` on SmolLM2-135M: 0.4 GB in float32).
    """

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def apply(self, model: torch.nn.Module, state: dict[str, torch.Tensor], info: AdapterInfo,
              origin: str = "adapter") -> None:
        """Set every target module's weight of ``model`` (a plain transformers model) to base + delta.

        Raises:
            ValueError: the adapter does not fit the model (names, ranks or shapes); ``model`` is unchanged.
        """
        pairs = _pairs(state, info, origin)
        weights = {}
        for m, (a, b) in pairs.items():
            try:
                w = model.get_submodule(m).weight
            except AttributeError:
                raise ValueError(f"{origin}: the model has no module {m}") from None
            if (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise ValueError(f"{origin}: {m}: B A is {[b.shape[0], a.shape[1]]}, the weight {list(w.shape)}")
            weights[m] = w
        with torch.no_grad():
            for m, w in weights.items():
                base = self.base.setdefault(m, w.detach().clone())
                a, b = pairs[m]
                w.copy_((base.float() + delta(a, b, info.scale)).to(w.dtype))

    def reset(self) -> None:
        """Forget the kept base weights after the model was loaded with full weights (they are the new base)."""
        self.base.clear()


def merge_weights(weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                  info: AdapterInfo) -> dict[str, torch.Tensor]:
    """Full weights with the adapter folded in: each target's ``<module>.weight`` + (alpha / r) · B A, in the
    weight's dtype; the other tensors as they are (for an export).

    Raises:
        ValueError: the adapter does not fit ``weights``.
    """
    out = dict(weights)
    for m, (a, b) in _pairs(state, info, "adapter").items():
        key = f"{m}.weight"
        if key not in out:
            raise ValueError(f"adapter: the weights have no {key}")
        w = out[key]
        out[key] = (w.float() + delta(a, b, info.scale)).to(w.dtype)
    return out
