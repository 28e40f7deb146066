"""Configuration of the rollout service (section ``rollout``)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.config import Settings, WeightsConfig
from shared.precision import DTypeChoice
from shared.topics import DEFAULT_POOL, POOL_PATTERN


class RolloutConfig(BaseModel):
    """Rollout settings. Env names: ``FLYWHEEL_ROLLOUT__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    pool: str = Field(DEFAULT_POOL, pattern=POOL_PATTERN)
    """The rollout pool whose requests this replica serves: it consumes only
    ``shared.topics.rollout_requests(pool)`` (``flywheel.rollout.requests`` for ``default``, else
    ``flywheel.rollout.requests.<pool>``), in consumer group ``rollout`` (default pool) or
    ``rollout-<pool>``. E.g. a ``long`` pool of replicas with a larger ``max_trajectory_tokens`` for
    long multi-turn domains (the scheduler's ``domains.<d>.pool`` routes them there)."""
    engine: Literal["torch", "sglang", "null"] = "torch"
    """Generation backend: ``torch`` (in-process transformers, CPU default), ``sglang`` (HTTP server) or ``null``
    (no model: fixed or random completions at ``null_tokens_per_s``, for benchmarking the pipeline; see
    rollout_service/null_engine.py)."""
    null_vocab: int = Field(64, ge=2, le=1 << 20)
    """``engine: null``: token ids are drawn from ``[0, null_vocab)``; behaviour log-prob ``-log(null_vocab)`` per token."""
    null_tokens_per_s: float = Field(0.0, ge=0.0, le=1e9)
    """``engine: null``: generation rate in tokens per second (0: as fast as possible)."""
    null_rate_per: Literal["sample", "batch"] = "sample"
    """``engine: null``: whether ``null_tokens_per_s`` is each sample's rate (the samples of a batch generate in
    parallel) or the whole batch's."""
    null_completion: Literal["random", "fixed"] = "random"
    """``engine: null``: uniformly random token ids (seeded by ``seed`` and the batch), or the same ids for every
    sample."""
    sglang_url: str = "http://127.0.0.1:30000"
    """Base URL of the SGLang server when ``engine == "sglang"``."""
    sglang_pause_mode: Literal["retract", "in_place", "abort"] = "retract"
    """How an SGLang server holds the requests in flight during a weight update: ``retract`` (re-prefill
    under the new weights), ``in_place`` (keep their stale KV cache) or ``abort`` (end them; the engine
    resubmits prompt + partial output). See rollout_service/sglang_engine.py."""
    max_batch_requests: int = Field(32, ge=1, le=4096)
    """Most rollout requests taken from Kafka and generated together in one batch."""
    max_batch_samples: int = Field(32, ge=1, le=65536)
    """Most samples (Σ n over requests) per generation batch: requests are taken until this is reached,
    the rest stay in Kafka for other replicas (backpressure). A single larger request still runs alone."""
    torch_threads: int = Field(1, ge=1, le=256)
    """``torch.set_num_threads`` for this process; two cores must not be oversubscribed."""
    burst_threads: int = Field(0, ge=0, le=256)
    """Torch engine: up to this many threads while the machine's other cores are idle (the trainer stepping
    on its own core leaves none; the trainer waiting for data leaves one), re-decided before every decoder
    layer (``shared/threads.py``). 0 (or ≤ ``torch_threads``): always ``torch_threads``."""
    dtype: DTypeChoice = "auto"
    """Weights dtype of the torch engine: ``auto`` (bfloat16 where the device runs it natively, AVX512_BF16 or
    AMX on a CPU; float32 elsewhere, where bf16 is emulated and about 50x slower; decided at start and logged,
    ``shared/precision.py``), ``float32`` or ``bfloat16``."""
    quantization: Literal["none", "int8"] = "none"
    """Torch engine: the weights that generate. ``none``: ``dtype``'s. ``int8``: an int8 copy of the body's linear
    layers (per-row int8 weights, activations quantized per batch at run time; embeddings, norms and the output
    layer stay float32), rebuilt after each weight version from a float32 master copy (``rollout.dtype`` is
    then ignored; ``rollout_service/quantize.py``). Faster on a CPU
    without native bf16 (SmolLM2, 32 samples: 1.76x the tokens per second of float32 on an AVX2 Zen 3) but
    far from the float32 policy: KL(fp32 ‖ int8) of 1.75 nats per token for SmolLM2, against 0.0024 for
    bf16 (``benchmarks/rollout_int8.py``), so its samples are strongly off-policy; not a default anywhere."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """Torch engine: the attention kernel (transformers' ``attn_implementation``). ``eager`` (matmul, softmax,
    matmul) is faster for short sequences on a CPU: each decode step is one query against a short cache, where
    ``sdpa``'s CPU flash kernel spent 1.1 ms a call (a quarter of the main job's generation time); 32 samples of
    ≤ 24 tokens took 0.84x the time per token in bf16 (``benchmarks/rollout_attention.py``). In the main job
    that did not show in the wall time (345 and 366 s against 357 s) and the rollout's peak RSS rose from 1,797
    to 2,348 MiB (oneDNN's cache of compiled matmul shapes: each decode step is a new key/value length;
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=64`` in the launcher's environment halved the rise), so the job keeps
    ``sdpa``. Eager's prefill holds a [batch, heads, L, L] score tensor: keep
    ``sdpa`` for long prompts or tool loops."""
    sandbox_url: str = "http://127.0.0.1:8100"
    """Base URL of the sandbox the tool loop calls (``run_python``, ``run_tests``)."""
    tool_timeout_s: float = Field(10.0, gt=0, le=300)
    """Time limit of one tool call in the sandbox (seconds)."""
    max_trajectory_tokens: int = Field(1024, ge=1, le=131072)
    """Budget of a multi-turn completion: generated plus tool-result tokens."""
    weight_update_policy: Literal["finish", "interrupt"] = "finish"
    """A weight version announced mid-generation: ``finish`` the batch, then load it; or ``interrupt``:
    load it between two decode steps and continue the unfinished samples with it (engines that support
    it; each token records its version, and the trainer's staleness bound counts the oldest)."""
    weight_poll_s: float = Field(0.5, gt=0, le=60)
    """How often to look for a newer weight version while waiting for ``min_policy_version`` (seconds)."""
    seed: int = 0
    """Base seed of the sampler; each batch reseeds from it and the batch counter."""


class RolloutSettings(Settings):
    """What the rollout process reads: its section, the shared ``weights``, and ``kafka``, ``model``, ``run``."""

    weights: WeightsConfig = WeightsConfig()
    rollout: RolloutConfig = RolloutConfig()
