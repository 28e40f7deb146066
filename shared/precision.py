"""Numeric precision chosen for the machine: bfloat16 where the device computes it natively, float32 elsewhere.

A CPU without bf16 matrix instructions (AVX2 only, no AVX512_BF16 and no AMX) emulates every bf16 matmul:
on an AMD EPYC Zen 3 a ``[512, 576] @ [576, 1536]`` matmul ran at 61.6 GFLOP/s in float32 and 1.1 GFLOP/s in
bfloat16 on one thread, 54 times slower, while a Zen 4 with AVX512_BF16 runs bf16 faster than float32. So
``auto`` (the default of ``rollout.dtype``, ``trainer.autocast_bf16`` and ``trainer.output_bf16``) is decided
once per process, at start, from what the hardware reports:

- a CUDA device: bf16 when ``torch.cuda.is_bf16_supported()``;
- a CPU: bf16 when torch's CPU feature probe (cpuinfo, the same that picks its kernels) reports AVX512_BF16 or
  AMX-BF16 tiles; float32 otherwise.

An explicit ``bfloat16`` is honoured everywhere; on a CPU without native support it is logged as a warning
with the slowdown measured by :func:`bf16_slowdown` (about 0.3 s).

``FLYWHEEL_NATIVE_BF16`` (``0`` or ``1``) overrides the hardware probe for the whole process: a stand-in
for a CPU with or without bf16 when measuring, never needed in normal use.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Literal

DTypeChoice = Literal["auto", "float32", "bfloat16"]
"""A precision setting: ``auto`` (decided by :func:`resolve_dtype`), or a dtype by name."""
FlagChoice = bool | Literal["auto"]
"""A bf16 on/off setting (``trainer.autocast_bf16``, ``trainer.output_bf16``): ``auto`` or a bool."""
ENV = "FLYWHEEL_NATIVE_BF16"

log = logging.getLogger("precision")


@dataclass(frozen=True)
class BF16Support:
    """What the device reports about bf16 arithmetic."""

    native: bool
    """True when bf16 matmuls run on the device's own instructions (AVX512_BF16, AMX, a CUDA GPU with bf16)."""
    reason: str
    """Why, in words, for the logs and the run report (e.g. ``"CPU without AVX512_BF16 or AMX (AVX2)"``)."""


def _cpu_flags() -> set[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where the file is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU as benchmark figures name it: ``model name`` from ``/proc/cpuinfo`` with its family and model
    numbers (``AMD EPYC (family 25 model 1)``: a virtual machine's name alone does not tell Zen 3 from Zen 4);
    ``"unknown CPU"`` where it is missing. :func:`cpu_features` says what it can do."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        return f"{fields['model name']} (family {fields['cpu family']} model {fields['model']})"
    return fields["model name"]


def cpu_features() -> str:
    """The vector features that decide Flywheel's speed, from the CPU's flags: ``avx2 avx512f avx512_bf16
    amx_bf16`` as present, or ``none of avx2, avx512f, avx512_bf16, amx_bf16``."""
    flags = _cpu_flags()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return " ".join(have) if have else "none of avx2, avx512f, avx512_bf16, amx_bf16"


def _torch_cpu_bf16() -> tuple[bool, str]:
    """(native, what was found) for this CPU, from torch's own feature probe where it has one, else the flags."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    probes = {"AVX512_BF16": getattr(torch._C._cpu, "_is_avx512_bf16_supported", None),
              "AMX": getattr(torch._C._cpu, "_is_amx_tile_supported", None)}
    if all(p is not None for p in probes.values()):
        found = [name for name, p in probes.items() if p()]
    else:  # an older torch: the kernel's own flags say the same
        flags = _cpu_flags()
        found = [name for name, flag in (("AVX512_BF16", "avx512_bf16"), ("AMX", "amx_bf16")) if flag in flags]
    return bool(found), (f"CPU {cpu_model()} with {' and '.join(found)}" if found
                         else f"CPU {cpu_model()} without AVX512_BF16 or AMX ({cap})")


@functools.cache
def probe_bf16(device: str = "cpu") -> BF16Support:
    """Whether ``device`` (``cpu`` or ``cuda``) runs bf16 natively; probed once per process.

    ``FLYWHEEL_NATIVE_BF16=0|1`` overrides the probe (the reason says so).
    """
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        return BF16Support(forced == "1", f"{ENV}={forced} (hardware probe overridden)")
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return BF16Support(True, f"CUDA device {torch.cuda.get_device_name()} with bf16")
        return BF16Support(False, "CUDA device without bf16")
    native, what = _torch_cpu_bf16()
    return BF16Support(native, what)


@dataclass(frozen=True)
class Precision:
    """One precision decision: what was asked, what is used, and why."""

    requested: str
    """The setting as configured (``auto``, ``float32``, ``bfloat16``, ``true``, ``false``)."""
    bf16: bool
    """Whether bf16 is used."""
    reason: str
    """Why, in words."""
    native: bool
    """Whether the device runs bf16 natively (:attr:`BF16Support.native`)."""
    hardware: str
    """What the device reported (:attr:`BF16Support.reason`)."""

    @property
    def dtype(self) -> str:
        """``bfloat16`` or ``float32``."""
        return "bfloat16" if self.bf16 else "float32"

    def as_dict(self) -> dict:
        """JSON-ready: dtype, requested, reason, native, hardware."""
        d = asdict(self)
        d.pop("bf16")
        return {"dtype": self.dtype, **d}


def resolve(requested: DTypeChoice | FlagChoice, support: BF16Support | None = None,
            device: str = "cpu") -> Precision:
    """Decide one precision setting.

    Args:
        requested: ``auto`` / ``float32`` / ``bfloat16``, or a bool for the on/off settings (True is bf16).
        support: the device's bf16 support; ``None``: :func:`probe_bf16` of ``device`` (cached per process).
        device: ``cpu`` or ``cuda``.

    Returns:
        The :class:`Precision`: bf16 for ``auto`` where the device runs it natively, float32 elsewhere; an
        explicit choice as given.

    Raises:
        ValueError: ``requested`` is none of these.
    """
    support = support or probe_bf16(device)
    if requested == "auto":
        if support.native:
            return Precision("auto", True, f"auto: bf16 ({support.reason})", True, support.reason)
        return Precision("auto", False, f"auto: float32 ({support.reason}; bf16 would be emulated)", False,
                         support.reason)
    if requested in ("bfloat16", True):
        return Precision(str(requested).lower(), True, f"configured bf16 ({support.reason})", support.native,
                         support.reason)
    if requested in ("float32", False):
        return Precision(str(requested).lower(), False, f"configured float32 ({support.reason})", support.native,
                         support.reason)
    raise ValueError(f"precision {requested!r}: expected auto, float32, bfloat16 or a bool")


@functools.cache
def bf16_slowdown(m: int = 64, k: int = 576, n: int = 1536, reps: int = 2) -> float:
    """Seconds of a bf16 ``[m, k] @ [k, n]`` matmul (a SmolLM2 MLP projection of 64 tokens) over float32's on
    this CPU, best of ``reps`` after a warm-up, on the current torch thread count: about 33 on an AVX2-only
    Zen 3 (39 against 1.2 GFLOP/s on one thread), below 1 with AVX512_BF16. Takes about 0.3 s where bf16 is
    emulated; measured once per process."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)  # warm-up: the first call picks and may compile its kernel
        out = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(x, y)
            out = min(out, time.perf_counter() - t)
        return out

    fp32 = best(a, b)
    return best(a.bfloat16(), b.bfloat16()) / max(fp32, 1e-9)


def choose(what: str, requested: DTypeChoice | FlagChoice, device: str = "cpu",
           support: BF16Support | None = None, slowdown: Callable[[], float] = bf16_slowdown,
           logger: logging.Logger = log) -> Precision:
    """:func:`resolve`, logged: the decision and its reason at INFO, and a WARNING with the measured slowdown
    (``slowdown()``) when bf16 is configured explicitly on a CPU that emulates it. ``what`` names the setting
    in the messages (``rollout.dtype``)."""
    p = resolve(requested, support, device)
    logger.info("%s = %s: %s", what, p.dtype, p.reason)
    if p.bf16 and not p.native and not device.startswith("cuda"):
        logger.warning("%s: bf16 is configured on a CPU without native bf16 (%s): a bf16 matmul here takes %.0fx "
                       "the time of float32; set it to auto or float32 unless you mean to measure this",
                       what, p.reason, slowdown())
    return p
