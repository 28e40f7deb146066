"""Configuration of the trainer service (section ``trainer``)."""

import logging
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.config import BudgetConfig, Settings, WeightsConfig, moved_keys
from shared.precision import FlagChoice, Precision, choose
from trainer_service.losses.config import GRPOLossConfig, LossConfig

MOVED: dict[str, str] = {
    **{k: f"budget.{k}" for k in ("batch_groups", "max_staleness", "max_steps")},
    "weight_transport": "weights.transport",
    **{k: f"weights.{k}" for k in ("broadcast_host", "broadcast_port", "broadcast_backend", "broadcast_timeout_s")},
    **{k: f"trainer.loss.{k}" for k in ("clip_eps", "clip_eps_high", "loss_agg", "max_response_tokens", "adv_eps",
                                        "off_policy", "is_cap")},
}
"""Keys that were ``trainer.<key>`` and where they live now (the loss fields under ``loss``, with its
``kind``: ``loss: {kind: grpo, clip_eps: 0.2}``)."""


def resolve_precision(cfg: "TrainerConfig", device: str = "cpu") -> tuple["TrainerConfig", dict[str, Precision]]:
    """``cfg`` with ``autocast_bf16`` and ``output_bf16`` decided for ``device`` (``auto`` becomes a bool,
    :func:`shared.precision.choose`: logged with its reason, and a warning with the measured slowdown for an
    explicit bf16 on a CPU that emulates it), and the two decisions by setting name."""
    log = logging.getLogger("trainer")
    dec = {k: choose(f"trainer.{k}", getattr(cfg, k), device, logger=log) for k in ("autocast_bf16", "output_bf16")}
    off_policy = getattr(cfg.loss, "off_policy", "decoupled")
    for k, p in dec.items():
        if (q := for_loss(p, off_policy)) is not p:
            dec[k] = q
            log.info("trainer.%s = float32: %s", k, q.reason)
    return cfg.model_copy(update={k: p.bf16 for k, p in dec.items()}), dec


def for_loss(p: Precision, off_policy: str) -> Precision:
    """``p`` (a trainer bf16 setting's decision), except that ``auto`` stays float32 unless the loss corrects for
    bf16 (``off_policy: decoupled``): a PPO clip against the behaviour log-probs takes bf16's rounding for policy
    change (0.22 held-out accuracy after 5 steps against 0.52 in fp32, measured on the main job)."""
    if p.requested != "auto" or not p.bf16 or off_policy == "decoupled":
        return p
    return replace(p, bf16=False, reason=f"auto: float32 (loss.off_policy {off_policy} would clip bf16's rounding "
                                         f"as policy change; {p.hardware})")


class LoraConfig(BaseModel):
    """``trainer.lora``: train low-rank adapters (peft) instead of every weight (``shared/lora.py``).

    Only the adapters get gradients and AdamW state; each version's weights event carries the adapter
    (``adapter_model.safetensors``, a few MB) and the rollout engines apply it to the base model. LoRA needs a
    larger learning rate than full fine-tuning: about 10x for the same result in RL at moderate rank ("LoRA
    Without Regret", Schulman et al., Thinking Machines 2025), which ``docs/guides/lora.md`` checks on the main job."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(16, ge=1, le=1024)
    """Rank of each adapter."""
    alpha: float = Field(32.0, gt=0, le=1e6)
    """Scale numerator: the adapter's update is (alpha / r) · B A."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """``all-linear`` (every linear layer of the body, not the output layer: the paper's finding is that
    attention-only LoRA underperforms) or module-name suffixes (``[q_proj, v_proj]``)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (0: the trainer's log-probs are the served policy's)."""


class TrainerConfig(BaseModel):
    """Trainer settings. Env names: ``FLYWHEEL_TRAINER__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    loss: LossConfig = Field(default_factory=GRPOLossConfig)
    """Loss family and its hyper-parameters, tagged by ``kind`` (``trainer_service/losses/config.py``, one
    class per kind with its defaults; each means TRL's ``loss_type`` of that name, the table in
    ``losses/__init__.py`` gives the verl settings): ``grpo`` (group mean/std advantages, PPO clip, mean per
    sequence then over sequences), ``bnpo`` (the same, mean over the batch's tokens), ``dr_grpo`` (no std
    division, token sum over a constant L_max), ``dapo`` (clip-higher 0.28, token mean; pair it with
    ``budget.oversample`` for dynamic sampling and ``truncation: penalise`` for overlong shaping), ``rloo``
    (leave-one-out baseline, token mean), ``gspo`` (sequence-level ratio). A string is the kind with its
    defaults (``loss: bnpo``); a mapping sets fields of that kind only (``loss: {kind: grpo, loss_agg:
    token_mean, clip_eps: 0.2}``): a field the kind does not have is an error."""
    lr: float = Field(1e-5, gt=0, le=1.0)
    """AdamW peak learning rate."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from lr / warm-up to lr (then ``lr_schedule``)."""
    stall_report_s: float = Field(30.0, gt=0)
    """Log what the group buffer holds when no step was taken for this long (seconds)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: ``constant``, or ``cosine`` decay from lr to ``lr_min_ratio`` · lr at ``budget.max_steps``
    (Loshchilov & Hutter 2017, SGDR; verl's ``lr_scheduler_type: cosine``)."""
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Floor of the cosine schedule as a fraction of lr."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    kl_coef: float = Field(0.0, ge=0.0)
    """β of the KL to the frozen base model (0 = off, and no reference model is kept). A trainer setting, not
    part of ``loss``: it applies to every loss kind (aggregated like the surrogate) and decides whether the
    trainer keeps a reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (``losses/kl.py``); every one contributes the gradient of KL(π_θ ‖ π_ref), importance-
    weighted by π_θ/π_behaviour for samples of older policies (TRL's ``use_bias_correction_kl``)."""
    truncation: Literal["mask", "penalise", "keep"] = "mask"
    """Samples cut at the token budget (finish_reason ``length``): ``mask`` (their tokens train
    nothing; they still count in their group's advantages; DAPO's overlong filtering), ``penalise``
    (reward minus ``truncation_penalty`` before advantages), or ``keep`` (train as scored)."""
    truncation_penalty: float = Field(1.0, ge=0.0)
    """Subtracted from a truncated sample's reward with ``truncation: penalise``."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    micro_batch_size: int = Field(8, ge=1, le=4096)
    """Trajectories per forward/backward pass; gradients accumulate over micro-batches."""
    torch_threads: int = Field(1, ge=1, le=256)
    """``torch.set_num_threads`` for this process."""
    burst_threads: int = Field(0, ge=0, le=256)
    """Up to this many threads while the machine's other cores are idle (a rollout replica waiting on the
    staleness budget leaves its core free), re-decided before every decoder layer's forward and backward
    (``shared/threads.py``). 0 (or ≤ ``torch_threads``): always ``torch_threads``. Measured alone with
    SmolLM2 (bf16, KL on): a step 3.9 s with 2 threads against 6.1 s with 1."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights (and of the AdamW state): keep float32 for small learning rates."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """The attention kernel (transformers' ``attn_implementation``). ``eager`` (matmul, softmax, matmul) is faster
    for short sequences on a CPU: a main-job SmolLM2 step (prompts of about 40 tokens, completions of ≤ 24) took
    about 0.6 s less of 6-7 s than with ``sdpa``, whose CPU flash kernel spent 11 ms per call there; ``sdpa``
    keeps memory linear in the length for long ones."""
    autocast_bf16: FlagChoice = "auto"
    """``auto`` (on where the device runs bf16 natively: AVX512_BF16 or AMX on a CPU, bf16 on a CUDA GPU, and the
    loss corrects for it, ``loss.off_policy: decoupled``; off elsewhere, where bf16 is emulated and 20-50x slower,
    or a PPO clip against the behaviour policy would clip its rounding; ``shared/precision.py``), or true/false.
    Run the transformer body under CPU/GPU bf16 autocast (float32 master weights and AdamW state); the
    log-softmax stays float32, and so does the output layer unless ``output_bf16``. The KL reference model is a
    bf16 copy (``trainer_service.trainer.reference_model``). Pair it with ``loss.off_policy: decoupled``: bf16
    log-probs differ from the behaviour log-probs by numerical noise (``mismatch/onpolicy_abs_logp_diff``,
    about 0.03 nats per token for SmolLM2 with a bf16 rollout), which a PPO clip against the behaviour policy
    takes for policy change. Measured on 2 cores: a SmolLM2 trainer step about 1.25x faster alone; the main job
    in 0.70x the wall time of fp32, held-out accuracy within 0.04 at steps 20 and 30 over 2 seeds (docs/results.md)."""
    output_bf16: FlagChoice = "auto"
    """``auto`` (as ``autocast_bf16``), or true/false. Compute the output layer's matmuls (forward and backward, ``[tokens, 576] @ [576, 49152]`` for SmolLM2) in
    bf16 on the CPU's matrix units; the log-sum-exp, the log-probs and the entropy stay float32, the master
    weights float32 (``trainer_service/token_logprobs.py``). bf16 logits round at a relative 2⁻⁹, as the
    rollout's bf16 engine rounds its own: watch ``mismatch/onpolicy_abs_logp_diff``. With ``autocast_bf16``
    the KL reference model is then bf16 throughout."""
    keep_checkpoints: int = Field(3, ge=1, le=1000)
    """Weight versions kept in the checkpoint store; older ones are deleted. Only the newest complete version
    keeps its optimizer and trainer state (what resume reads); the older ones keep their weights for rollout
    engines that lag (``shared/checkpoint.py``)."""
    drop_optimizer_on_finish: bool = False
    """At ``budget.max_steps`` write the last version without its optimizer state (AdamW moments: twice the
    weights, ~1.1 GB for SmolLM2), so a finished run keeps weights and counters only. Such a run can still be
    restarted at ``max_steps`` (nothing left to train) but not continued past it: raising ``max_steps`` on it
    is refused at start-up. Off by default so that a finished run can be extended exactly."""
    disk_reserve_bytes: int = Field(256 * 1024 * 1024, ge=0, le=1 << 50)
    """A checkpoint is written only when the checkpoint store's file system keeps at least this many bytes
    free after it (bytes, for the logs, the registry and other processes). Otherwise the trainer takes no
    new step, alerts ``critical`` (``run/disk_free`` on flywheel.alerts, the log, the
    ``flywheel_trainer_disk_*`` gauges) and retries every ``disk_retry_s`` until space is freed
    (``flywheel clean``); it never dies of a full disk and never leaves a half-written version."""
    disk_warn_checkpoints: float = Field(3.0, ge=1.0, le=1000.0)
    """Alert ``warning`` while fewer than this many more checkpoints (each the size of the one being written)
    fit in the free space above ``disk_reserve_bytes``."""
    disk_retry_s: float = Field(10.0, gt=0, le=3600)
    """Seconds between free-space checks while a checkpoint waits for space."""
    drain_broker_wait_s: float = Field(10.0, ge=0.0, le=120.0)
    """Seconds a graceful stop waits for a broker that is away (as the broker watch saw it) before it gives up
    the announcements of the version being published. The trainer waits up to 120 s for that version; when
    the broker is gone (the supervisor's death takes it down with the services) it waited all of them. Given
    up, the version's files are still written whole (weights, optimizer and trainer state), no offset is
    committed, and the next start resumes at that version exactly and announces its weights (that step's
    metrics records are not sent). A stop between two broker sessions (during an outage) gives them up at
    once. With ``null_step`` nothing is written, so nothing is resumed either."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (:class:`LoraConfig`); None: full fine-tuning. Needs
    ``weights.transport: checkpoint`` and the torch rollout engine."""
    seed: int = 0
    """Seed of torch and the trainer's RNG."""
    null_step: bool = False
    """Benchmark knob, not for training: no model is loaded and each optimizer step is a no-op
    (``trainer_service/null_step.py``). The trainer still assembles groups, drops stale and failed ones,
    counts steps, announces each policy version on flywheel.weights (a manifest-less WeightUpdate, transport
    ``checkpoint``, that only a ``rollout.engine: null`` replica can "load"), sends its step metrics and
    commits offsets; it writes no checkpoint, so a restart starts again at version 0 and does not remember
    the groups trained. What ``benchmarks/null_pipeline.py`` measures: the message bus and the services
    without a model."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """Raises ValueError for keys that moved out of the section (:data:`MOVED`), naming where they live."""
        return moved_keys("trainer", data, MOVED)


class SftConfig(BaseModel):
    """``sft``: the supervised fine-tuning stage (``flywheel sft``, or ``stages: [sft, rl]``): train the model of
    ``model.name`` on chat transcripts, loss on the assistant tokens only, and write a Hugging Face folder that the
    RL stage loads as its base model (``trainer_service/sft.py``, ``docs/guides/sft.md``). The weights' dtype,
    the attention kernel, ``autocast_bf16``, ``max_grad_norm``, AdamW's betas and weight decay and
    ``torch_threads`` are the ``trainer`` section's."""

    model_config = ConfigDict(extra="forbid")
    data: str
    """Training rows: a JSONL or Parquet file, or a folder written by ``datasets``' ``save_to_disk``. Each row
    has ``messages`` (a list of ``{role, content}``, at least one ``assistant``) and optionally ``tools`` (a list
    of tool schemas, or its JSON), passed to the chat template as ``tools=``."""
    eval_data: str | None = None
    """Held-out rows in the same format; None: hold out ``eval_fraction`` of ``data``."""
    eval_fraction: float = Field(0.05, ge=0.0, le=0.5)
    """Share of ``data`` held out for the eval loss when ``eval_data`` is not given (a split seeded by ``seed``;
    at least one row when the share is above 0 and ``data`` has two rows or more)."""
    epochs: int = Field(1, ge=1, le=1000)
    """Passes over the training rows."""
    lr: float = Field(1e-5, gt=0, le=1.0)
    """AdamW learning rate (constant)."""
    batch_size: int = Field(8, ge=1, le=4096)
    """Rows per optimizer step."""
    micro_batch_size: int = Field(4, ge=1, le=4096)
    """Rows per forward/backward pass (gradients accumulate over a step's passes; the loss is the same as one
    pass of ``batch_size`` rows): lower it when a step does not fit in memory."""
    max_length: int = Field(1024, ge=8, le=1 << 20)
    """Tokens per row; a longer row is cut at the end (counted in the log and the report) and a row left with
    no assistant token is dropped."""
    seed: int = 0
    """Seed of the eval split, the batch order and torch."""
    output: str | None = None
    """Where the fine-tuned model is written (a Hugging Face folder); None:
    ``<run.dir>/<config name>-sft-<date-time>/model``. ``sft_report.json`` goes beside it. Must not hold a model
    already."""
    log_every: int = Field(10, ge=1, le=1_000_000)
    """Print a progress line every this many optimizer steps (and one per epoch)."""


class TrainerSettings(Settings):
    """What the trainer process reads: its section, the shared ``weights`` and ``budget``, and ``kafka``,
    ``model``, ``run``."""

    weights: WeightsConfig = WeightsConfig()
    budget: BudgetConfig = BudgetConfig()
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """A factory, not an instance: with ``nested_model_default_partial_update`` pydantic-settings merges the
    dump of a default *instance* under the file and the environment, which would fill a ``loss: {kind:
    dapo}`` mapping with ``grpo``'s defaults (and reject ``gspo``'s missing fields)."""

    @model_validator(mode="after")
    def _lora_transport(self) -> "TrainerSettings":
        """Raises ValueError for LoRA with the broadcast transport (it sends full weights only)."""
        if self.trainer.lora is not None and self.weights.transport != "checkpoint":
            raise ValueError("trainer.lora needs weights.transport: checkpoint (the broadcast sends full weights)")
        return self

    @classmethod
    def normalise(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``trainer.loss: bnpo`` → ``trainer.loss: {kind: bnpo}``, so that an override of one loss field
        (``FLYWHEEL_TRAINER__LOSS__CLIP_EPS``, ``--set trainer.loss.clip_eps=...``) keeps the file's kind."""
        data = super().normalise(data)
        trainer = data.get("trainer")
        if isinstance(trainer, dict) and isinstance(trainer.get("loss"), str):
            data = {**data, "trainer": {**trainer, "loss": {"kind": trainer["loss"]}}}
        return data
