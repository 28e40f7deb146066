"""Supervised fine-tuning (SFT) on chat transcripts: the stage before RL that teaches the format.

Rows are chat ``messages`` (``[{role, content}, ...]``) with optional ``tools`` (the TRL / prime-rl convention).
Each row is rendered with the model's chat template and tokenized once; the loss is on the assistant tokens only
(each assistant message's content and the template's end-of-turn mark after it; the system and user turns, tool
results and the template's role headers are context, not targets, :func:`encode_row`).

Normalisation: the summed token cross-entropy of a step's assistant tokens divided by their number (a token-level
mean over the whole step, whatever the micro-batching: :func:`sft_loss`). It is TRL's SFTTrainer default (a
cross-entropy averaged over the non-ignored labels), weighs every demonstrated token alike, so a long answer counts
for more than a short one, as it does in its likelihood. The eval loss is the same mean over the held-out rows.

Simplified on purpose: a constant learning rate (no warm-up or decay), no packing (rows are batched in length
buckets instead, :func:`length_batches`), full fine-tuning only (no LoRA), the CPU or the one device the model is on.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from trainer_service.config import SftConfig, TrainerConfig

log = logging.getLogger("trainer.sft")

CHUNK_BATCHES = 16
"""Batches per shuffled chunk in :func:`length_batches`: rows are sorted by length within a chunk of this many
batches, so a batch holds rows of similar length (little padding) while the order stays random across chunks."""


class SftDataError(ValueError):
    """The SFT data cannot be used: a missing file, an unreadable format, or a row that is not a conversation with
    an assistant message. The message names the field (``sft.data`` or ``sft.eval_data``) and the row."""


@dataclass
class Encoded:
    """One tokenized row: ``ids`` (token ids, ``max_length`` at most), ``mask`` (1 on the assistant tokens the
    loss is on, 0 elsewhere; as long as ``ids``) and whether the row was cut at ``max_length``."""

    ids: list[int]
    mask: list[int]
    truncated: bool = False


@dataclass
class SftData:
    """The tokenized train and eval rows, and what was cut or dropped on the way (for the log and the report)."""

    train: list[Encoded]
    eval: list[Encoded]
    truncated: int = 0
    """Rows cut at ``sft.max_length`` (train and eval)."""
    dropped: int = 0
    """Rows with no assistant token left after the cut (not trained on)."""
    stats: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ reading rows
def read_rows(path: str, what: str = "sft.data") -> list[dict]:
    """The rows of ``path``, read by :func:`shared.envs.datasets.read_source` (JSONL, JSON, Parquet, CSV, or a
    ``datasets`` folder's ``train`` split). ``what`` names the config field in errors.

    Raises:
        SftDataError: the path does not exist, its format is unknown, or it is not valid JSON.
    """
    import orjson

    from shared.envs.datasets import DatasetError, read_source

    if not Path(os.path.expanduser(path)).exists():
        raise SftDataError(f"{what}: {path!r} does not exist")
    try:
        return list(read_source(path, "train"))
    except (DatasetError, orjson.JSONDecodeError, ImportError) as e:
        raise SftDataError(f"{what}: {' '.join(str(e).split())}") from None


def check_row(row: Any, where: str) -> tuple[list[dict], list[dict] | None]:
    """The ``messages`` and ``tools`` of ``row`` (``tools`` given as JSON text is parsed). ``where`` names the
    row in errors (``sft.data row 3``).

    Raises:
        SftDataError: the row is not an object, has no non-empty ``messages`` list, a message lacks ``role``,
            or no message is the assistant's.
    """
    if not isinstance(row, dict):
        raise SftDataError(f"{where}: not an object")
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise SftDataError(f"{where}: no `messages` list (a list of {{role, content}})")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SftDataError(f"{where}: messages[{j}] has no `role`")
    if not any(m["role"] == "assistant" for m in msgs):
        raise SftDataError(f"{where}: no assistant message (nothing to learn)")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise SftDataError(f"{where}: `tools` is text but not JSON: {e}") from None
    return msgs, tools or None


# ------------------------------------------------------------------ tokenizing
def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                         tokenize=False)


def assistant_spans(tokenizer, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, stop)`` of its assistant turns.

    For the assistant message ``i`` the span starts where the rendering of ``messages[:i]`` with the generation
    prompt ends (after the template's assistant header) and stops where the rendering of ``messages[:i + 1]``
    ends, less trailing whitespace: the content and the template's end-of-turn mark (``<|im_end|>`` for ChatML),
    not the newline after it. When the template ends a turn with whitespace only (no mark), its first character
    is kept as the end-of-turn, so the model learns to stop. Works for any template whose rendering of a prefix
    of the conversation is a prefix of the rendering of the whole.

    Raises:
        ValueError: the conversation starts with an assistant message, or the template renders a prefix of the
            conversation differently from the whole (it rewrites earlier turns), so the spans cannot be found.
    """
    full = _render(tokenizer, messages, tools, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:  # nothing to render before it (transformers refuses an empty conversation)
            raise ValueError("messages[0] is an assistant message: start with a system or user message")
        before = _render(tokenizer, messages[:i], tools, True)
        upto = _render(tokenizer, messages[:i + 1], tools, False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(f"the chat template renders messages[:{i}] differently from the whole conversation")
        turn = upto[len(before):]
        kept = turn.rstrip()
        content = (m.get("content") or "").rstrip() if isinstance(m.get("content"), str) else ""
        if content and kept.endswith(content) and len(kept) < len(turn):  # whitespace is the end of the turn
            kept = turn[:len(kept) + 1]
        spans.append((len(before), len(before) + len(kept)))
    return full, spans


def encode_row(tokenizer, messages: list[dict], tools=None, max_length: int = 1024) -> Encoded:
    """Token ids of the conversation rendered by the chat template and its assistant-only loss mask.

    A token is an assistant token when its first character lies in an assistant span (:func:`assistant_spans`),
    found by the tokenizer's character offsets (a fast tokenizer). The rendering's tokens are taken as they are
    (``add_special_tokens=False``: the template writes its own BOS where it wants one); a row longer than
    ``max_length`` tokens is cut at the end.

    Raises:
        ValueError: as :func:`assistant_spans`.
    """
    text, spans = assistant_spans(tokenizer, messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(a <= s < b for a, b in spans) and e > s) for s, e in offsets]
    cut = len(ids) > max_length
    return Encoded(ids[:max_length], mask[:max_length], cut)


def load_data(cfg: SftConfig, tokenizer) -> SftData:
    """Read, check, split and tokenize the rows of ``cfg.data`` (and ``cfg.eval_data``).

    Without ``eval_data``, ``eval_fraction`` of the rows (at least one when the fraction is above 0 and there are
    two rows or more) is held out by a permutation seeded by ``cfg.seed``.

    Raises:
        SftDataError: :func:`read_rows`' and :func:`check_row`'s errors, naming the field and the row (1-based,
            in the file's order); a row the chat template cannot render or whose assistant turns cannot be found
            (:func:`encode_row`); no training row.
    """
    rows = [(f"sft.data row {i}", r) for i, r in enumerate(read_rows(cfg.data, "sft.data"), 1)]
    if cfg.eval_data is not None:
        held = [(f"sft.eval_data row {i}", r) for i, r in enumerate(read_rows(cfg.eval_data, "sft.eval_data"), 1)]
    else:
        n_eval = 0 if cfg.eval_fraction == 0 or len(rows) < 2 else max(1, round(cfg.eval_fraction * len(rows)))
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
        held = [rows[i] for i in sorted(order[:n_eval])]
        rows = [rows[i] for i in sorted(order[n_eval:])]
    if not rows:
        raise SftDataError(f"sft.data: {cfg.data!r} has no training rows")
    out = SftData([], [])
    for part, dest in ((rows, out.train), (held, out.eval)):
        for where, row in part:
            msgs, tools = check_row(row, where)
            try:
                enc = encode_row(tokenizer, msgs, tools, cfg.max_length)
            except ValueError as e:
                raise SftDataError(f"{where}: {e}") from None
            except Exception as e:  # the template's own errors (jinja's, a role it refuses)
                raise SftDataError(f"{where}: the chat template cannot render it: {type(e).__name__}: {e}") from None
            out.truncated += enc.truncated
            if sum(enc.mask[1:]) == 0:  # the first token has nothing before it to predict it from
                out.dropped += 1
                continue
            dest.append(enc)
    if not out.train:
        raise SftDataError(f"sft.data: no row has an assistant token within sft.max_length={cfg.max_length}")
    return out


# ------------------------------------------------------------------ batching
def length_batches(lengths: list[int], batch_size: int, rng: random.Random,
                   chunk_batches: int = CHUNK_BATCHES) -> list[list[int]]:
    """Row indices in batches of ``batch_size`` (the last one may be smaller) for one epoch: the rows shuffled,
    cut into chunks of ``chunk_batches`` batches, each chunk sorted by length (rows of similar length share a
    batch, so little is padded) and cut into batches, and the batches shuffled."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    size = batch_size * chunk_batches
    batches = []
    for c in range(0, len(order), size):
        chunk = sorted(order[c:c + size], key=lambda i: lengths[i])
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(rows: list[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` padded on the right to the longest: ids ``[B, T]`` long, attention mask ``[B, T]`` long (1 on real
    tokens), loss mask ``[B, T]`` long (1 on assistant tokens)."""
    T = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r.ids)
        ids[b, :n] = torch.tensor(r.ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(r.mask)
    return ids, attn, mask


# ------------------------------------------------------------------ the loss
def sft_loss(logits: torch.Tensor, targets: torch.Tensor, normaliser: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of the assistant tokens, summed and divided by ``normaliser``.

    Args:
        logits: ``[N, V]``, any float dtype (computed in float32): the model's output at the position before each
            of the N assistant tokens.
        targets: ``[N]`` long: the assistant tokens.
        normaliser: the number of assistant tokens in the whole optimizer step (≥ 1), so that the micro-batches'
            losses add up to the token-level mean over the step (TRL's SFT default).

    Returns:
        The loss (a scalar with gradient) and metrics: ``loss/nll_sum`` (nats) and ``loss/tokens`` (N).
    """
    nll = F.cross_entropy(logits.float(), targets, reduction="sum")
    return nll / normaliser, {"loss/nll_sum": float(nll.detach()), "loss/tokens": float(targets.numel())}


def assistant_logits(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor,
                     autocast_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits ``[N, V]`` that predict the N assistant tokens of a batch, and those tokens ``[N]``.

    ``ids``, ``attn``, ``mask``: ``[B, T]`` (:func:`collate`). The transformer body runs on the whole batch (under
    bf16 autocast with ``autocast_bf16``); only the N positions before an assistant token go through the output
    layer, in the head's dtype, so a long prompt costs no ``[T, V]`` logits.
    """
    body, head = model.get_decoder(), model.get_output_embeddings()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        hidden = body(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H]
    sel = mask[:, 1:].bool()  # token t + 1 is predicted from the hidden state at t
    h = hidden[:, :-1][sel]  # [N, H]
    return head(h.to(head.weight.dtype)), ids[:, 1:][sel]


# ------------------------------------------------------------------ the loop
@dataclass
class SftTrainer:
    """The model, its AdamW (``trainer``'s betas and weight decay, ``sft.lr``, gradients clipped to
    ``trainer.max_grad_norm``) and the SFT steps."""

    model: torch.nn.Module
    cfg: SftConfig
    trainer: TrainerConfig
    pad_id: int
    autocast_bf16: bool = False
    emit: Callable[[str], None] = print
    """Where the progress lines go (one line each)."""

    def __post_init__(self) -> None:
        from trainer_service.trainer import _fused_ok

        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=self.trainer.betas,
                                           weight_decay=self.trainer.weight_decay, fused=_fused_ok(params))
        self.step = 0

    def train_step(self, rows: list[Encoded]) -> dict[str, float]:
        """One optimizer step on ``rows``: forward/backward per micro-batch of ``sft.micro_batch_size`` rows, the
        loss normalised by the step's assistant tokens (:func:`sft_loss`), clip, AdamW. Returns ``loss/train``
        (nats per assistant token), ``loss/tokens``, ``train/grad_norm`` and ``train/input_tokens``."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n = sum(sum(r.mask[1:]) for r in rows)
        nll, seen = 0.0, 0
        for m in range(0, len(rows), self.cfg.micro_batch_size):
            ids, attn, mask = collate(rows[m:m + self.cfg.micro_batch_size], self.pad_id)
            logits, targets = assistant_logits(self.model, ids, attn, mask, self.autocast_bf16)
            loss, metrics = sft_loss(logits, targets, n)
            loss.backward()
            nll += metrics["loss/nll_sum"]
            seen += int(attn.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.trainer.max_grad_norm)
        self.optimizer.step()
        self.step += 1
        return {"loss/train": nll / n, "loss/tokens": float(n), "train/grad_norm": float(grad_norm),
                "train/input_tokens": float(seen)}

    @torch.no_grad()
    def eval_loss(self, rows: list[Encoded]) -> float | None:
        """Mean cross-entropy per assistant token over ``rows`` (nats), or None without rows."""
        if not rows:
            return None
        self.model.eval()
        nll, n = 0.0, 0
        for m in range(0, len(rows), self.cfg.micro_batch_size):
            ids, attn, mask = collate(rows[m:m + self.cfg.micro_batch_size], self.pad_id)
            logits, targets = assistant_logits(self.model, ids, attn, mask, self.autocast_bf16)
            nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
            n += targets.numel()
        return nll / n

    def fit(self, data: SftData) -> list[dict[str, Any]]:
        """``sft.epochs`` passes over ``data.train`` in length buckets (:func:`length_batches`, seeded by
        ``sft.seed``), a progress line every ``sft.log_every`` steps and one per epoch; returns one record per
        epoch: ``epoch``, ``steps``, ``train_loss`` (the epoch's mean per assistant token), ``eval_loss``,
        ``tokens_per_s`` (input tokens, padding excluded) and ``seconds``."""
        rng = random.Random(self.cfg.seed)
        lengths = [len(r.ids) for r in data.train]
        epochs = []
        for epoch in range(1, self.cfg.epochs + 1):
            t0 = time.monotonic()
            total = {"nll": 0.0, "n": 0, "tokens": 0}  # the epoch's sums
            window = {"nll": 0.0, "n": 0, "tokens": 0, "t": t0}  # since the last progress line
            for batch in length_batches(lengths, self.cfg.batch_size, rng):
                m = self.train_step([data.train[i] for i in batch])
                for sums in (total, window):
                    sums["nll"] += m["loss/train"] * m["loss/tokens"]
                    sums["n"] += int(m["loss/tokens"])
                    sums["tokens"] += int(m["train/input_tokens"])
                if self.step % self.cfg.log_every == 0:
                    dt = max(time.monotonic() - window["t"], 1e-9)
                    self.emit(f"sft step {self.step} epoch {epoch}: train loss {window['nll'] / window['n']:.4f} "
                              f"grad norm {m['train/grad_norm']:.3f} {window['tokens'] / dt:.0f} tok/s")
                    window = {"nll": 0.0, "n": 0, "tokens": 0, "t": time.monotonic()}
            seconds = time.monotonic() - t0
            ev = self.eval_loss(data.eval)
            rec = {"epoch": epoch, "steps": self.step, "train_loss": total["nll"] / total["n"], "eval_loss": ev,
                   "tokens_per_s": total["tokens"] / max(seconds, 1e-9), "seconds": seconds}
            epochs.append(rec)
            self.emit(f"sft epoch {epoch}/{self.cfg.epochs} (step {self.step}): train loss {rec['train_loss']:.4f} "
                      f"eval loss {'-' if ev is None else f'{ev:.4f}'} {rec['tokens_per_s']:.0f} tok/s "
                      f"{seconds:.1f} s")
        return epochs


def save_model(model: torch.nn.Module, tokenizer, output: Path) -> Path:
    """Write ``model`` (safetensors, its config and generation config) and ``tokenizer`` (with its chat template)
    to ``output`` as a Hugging Face folder: into a temporary sibling first, then renamed, so a crash never leaves
    half a model where the RL stage would load it.

    Raises:
        FileExistsError: ``output`` already holds a model (``config.json``).
    """
    if (output / "config.json").exists():
        raise FileExistsError(f"sft.output {output} already holds a model")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if output.exists():
        output.rmdir()  # an empty folder (a non-empty one makes rmdir raise OSError, naming it)
    os.replace(tmp, output)
    return output


def run_sft(model_dir: Path, cfg: SftConfig, trainer: TrainerConfig, output: Path,
            emit: Callable[[str], None] = print) -> dict[str, Any]:
    """The SFT stage: read and tokenize the rows (:func:`load_data`, before the model is loaded, so bad data
    fails fast), load the model of ``model_dir`` as the trainer does (``trainer.dtype``, ``trainer.attention``,
    ``trainer.autocast_bf16`` decided by :func:`shared.precision.choose`, ``trainer.torch_threads``), train
    (:class:`SftTrainer`), write the model to ``output`` (:func:`save_model`) and the report to
    ``output.parent / "sft_report.json"``. Returns the report.

    Raises:
        SftDataError: the data cannot be used (the message names the field and the row).
        FileExistsError: ``output`` already holds a model, or is a file or a folder that is not empty.
    """
    from transformers import AutoTokenizer

    from shared.model import load_model
    from shared.precision import choose

    if (output / "config.json").exists():
        raise FileExistsError(f"sft.output {output} already holds a model")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):  # refused now, not after training
        raise FileExistsError(f"sft.output {output} exists and is not an empty folder")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = load_data(cfg, tokenizer)
    emit(f"sft data: {len(data.train)} train rows, {len(data.eval)} eval rows, {data.truncated} cut at "
         f"max_length {cfg.max_length}, {data.dropped} dropped (no assistant token left)")
    torch.set_num_threads(trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir, trainer.dtype, trainer.attention)
    precision = choose("trainer.autocast_bf16", trainer.autocast_bf16, next(model.parameters()).device.type,
                       logger=log)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sft = SftTrainer(model, cfg, trainer, pad_id, precision.bf16, emit)
    t0 = time.monotonic()
    epochs = sft.fit(data)
    model.eval()
    save_model(model, tokenizer, output)
    report = {"base_model": str(model_dir), "output": str(output), "steps": sft.step, "epochs": epochs,
              "eval_loss": epochs[-1]["eval_loss"], "train_rows": len(data.train), "eval_rows": len(data.eval),
              "truncated_rows": data.truncated, "dropped_rows": data.dropped, "seconds": time.monotonic() - t0,
              "normalisation": "mean cross-entropy per assistant token over each optimizer step",
              "precision": {"weights": trainer.dtype, "autocast_bf16": precision.as_dict()},
              "config": cfg.model_dump()}
    (output.parent / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    emit(f"sft: wrote {output} ({sft.step} steps) and {output.parent / 'sft_report.json'}")
    return report
