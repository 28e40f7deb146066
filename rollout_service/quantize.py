"""int8 weights for the torch engine, where bf16 is emulated and float32 is the only other choice.

One small interface, :func:`int8_runner`, over whichever kernel does the work. Today that is PyTorch's
dynamic quantization (``torch.ao.quantization.quantize_dynamic``: per-row int8 weights, activations quantized
per batch at run time, x86/fbgemm kernels), the fastest maintained CPU path measured here: on an AVX2-only AMD
EPYC (SmolLM2, 32 samples with a KV cache, one thread) it generated 1.76x the tokens per second of float32,
where torchao 0.18's eager CPU path was slower than float32 (int8 weight-only 102 tokens/s against 136-148;
its dynamic int8 9 tokens/s) and needs ``torch.compile`` to pay. ``torch.ao``'s eager quantization API is
marked deprecated in favour of torchao; when it goes, this module is the one place to change (torchao's
``Int8DynamicActivationInt8WeightConfig`` under ``torch.compile``, or oneDNN's int8 matmul).

What it costs in fidelity decides where it may be used. One activation scale per batch cannot hold SmolLM2's
outlier channels (the RMSNorm outputs feeding q/k/v and gate/up, the SiLU product feeding down_proj): the int8
model's next-token distribution is KL 1.75 nats per token from float32's with every linear layer int8 (0.15
with q/k/v alone, 0.01 with o_proj alone), and still 0.32 after SmoothQuant-style smoothing (Xiao et al. 2023,
alpha 0.7, folded into the norms and up_proj); bf16 weights give 0.0024 on the same text. Samples that far from the trainer's policy
are strongly off-policy even with the decoupled correction, so ``rollout.quantization: int8`` is an explicit
opt-in, never a default. Per-token activation scales or weight-only int8 with a fast kernel would change that.

The engine keeps the float32 model as the master copy: weight versions load into it exactly as without
quantization (``shared.model_weights.load_weights``), and the int8 runner is rebuilt from it after each load
(:class:`rollout_service.torch_engine.TorchEngine`). The behaviour log-probs are the int8 model's.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

log = logging.getLogger("rollout.quantize")

Quantization = Literal["none", "int8"]
"""``rollout.quantization``: the torch engine's generation weights."""


def int8_supported() -> bool:
    """Whether this torch has a CPU int8 engine (``x86`` or ``fbgemm``) for dynamic quantization."""
    return bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines))


def int8_runner(model: torch.nn.Module, keep_output_layer: bool = True) -> torch.nn.Module:
    """An int8 copy of ``model`` for generation: every ``nn.Linear`` of the decoder body with int8 weights (per
    output row) and activations quantized dynamically; embeddings, norms and, with ``keep_output_layer``, the
    output layer (``lm_head``, whose logits give the behaviour log-probs) stay float32. ``model`` is unchanged.

    Raises:
        RuntimeError: this torch has no CPU int8 engine (:func:`int8_supported`).
    """
    if not int8_supported():
        raise RuntimeError("rollout.quantization: int8 needs torch's x86 or fbgemm quantized engine, which this "
                           f"torch lacks ({torch.backends.quantized.supported_engines})")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if keep_output_layer:
        names.discard("lm_head")
    import warnings

    with warnings.catch_warnings():  # torch.ao's eager API warns that it is deprecated (module docstring)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        runner = quantize_dynamic(model, {n: per_channel_dynamic_qconfig for n in names}, dtype=torch.qint8,
                                  inplace=False)
    return runner.eval()
