"""``flywheel export``: a run's policy version as a Hugging Face model folder (:mod:`flywheel.export`).

Needs no running system. Anything in the way (no run directory, no checkpoints, an unknown version, an output
folder that is not empty) stops it with one line on stderr, exit 2, and nothing written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from flywheel.cli.common import console


def export_cmd(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (its checkpoints/ holds the versions).")],
    out: Annotated[Path, typer.Argument(help="The folder to write (must not exist, or be empty).")],
    version: Annotated[Optional[int], typer.Option(
        help="The policy version to export (default: the newest published one).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT when it is not empty.")] = False,
    dtype: Annotated[Optional[str], typer.Option(
        help="float32, bfloat16 or float16 (default: the checkpoint's, float32).")] = None,
    base_model: Annotated[Optional[Path], typer.Option(
        help="The base model's directory, when the one the run used has moved.")] = None,
) -> None:
    """Export a trained policy version as a Hugging Face model folder: config, generation config, tokenizer with
    its chat template, model.safetensors (a LoRA version merged into the base) and a README.md model card with
    the run's config and held-out figures. Loads with AutoModelForCausalLM.from_pretrained(OUT)."""
    from transformers.utils import logging as hf_logging

    from flywheel.export import ExportError, export_checkpoint  # torch and transformers: only when exporting

    hf_logging.disable_progress_bar()  # the status line says what runs; stderr is for the one-line error
    try:
        with Console(stderr=True).status(f"exporting {run_dir} to {out}"):
            result = export_checkpoint(run_dir, out, version=version, force=force, dtype=dtype, base_model=base_model)
    except ExportError as e:
        Console(stderr=True, soft_wrap=True).print(f"[red]export: {escape(' '.join(str(e).split()))}[/]")
        raise typer.Exit(2) from None
    what = "LoRA adapter merged into the base" if result.lora else "full weights"
    console.print(f"exported policy version {result.version} (step {result.step}, {what}, {result.dtype}) of run "
                  f"{result.run.run_id} to {result.out}: {', '.join(result.files)}", highlight=False)
