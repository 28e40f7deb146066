"""``flywheel sft``: the supervised fine-tuning stage on its own (``trainer_service/sft.py``); ``flywheel run`` runs
it first with ``stages: [sft, rl]`` (:func:`run_sft_stage`) and starts the RL run from its output."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from flywheel.cli.common import ConfigArg, SetOpt, _load, config_error, console


def sft(config: ConfigArg, set_: SetOpt = None) -> None:
    """Fine-tune ``model.name`` on the ``sft`` section's chat transcripts (loss on the assistant tokens only) and
    write a Hugging Face folder at ``sft.output`` (default ``<run.dir>/<config name>-sft-<date-time>/model``),
    with ``sft_report.json`` beside it. Give that folder as ``model.name`` to start RL from it (or use
    ``stages: [sft, rl]`` with ``flywheel run``)."""
    logging.basicConfig(level=logging.WARNING)
    cfg = _load(config, set_)[0]
    if cfg.sft is None:
        raise config_error(config, ["sft: flywheel sft needs an sft: section (at least sft.data)"])
    run_sft_stage(config, cfg)


def sft_output(config: Path, cfg) -> Path:
    """Where the SFT model goes: ``sft.output``, else ``<run.dir>/<config name>-sft-<date-time>/model``."""
    if cfg.sft.output:
        return Path(os.path.expanduser(cfg.sft.output)).resolve()
    base = Path(os.path.expanduser(cfg.run.dir)).resolve()
    return base / f"{config.stem}-sft-{time.strftime('%Y%m%d-%H%M%S')}" / "model"


def run_sft_stage(config: Path, cfg) -> Path:
    """Run the SFT stage of the root config ``cfg`` (loaded from ``config``) in this process and return the folder
    it wrote. Data that cannot be used (a missing file, a row without ``messages`` or without an assistant
    message) or an ``output`` that holds a model already stops the command (exit 2) with one line naming the field
    and the row, before the model is loaded."""
    import typer

    from shared.model import resolve_model_dir
    from trainer_service.sft import SftDataError, run_sft

    output = sft_output(config, cfg)
    with console.status("preparing the model (converted once, then cached)"):
        model_dir = resolve_model_dir(cfg.model.name, cfg.model.cache_dir)
    console.print(f"sft: {model_dir} → {output}", markup=False, highlight=False)
    try:
        run_sft(model_dir, cfg.sft, cfg.trainer, output,
                emit=lambda line: console.print(line, markup=False, highlight=False))
    except (SftDataError, FileExistsError) as e:
        raise config_error(config, [str(e)]) from None
    except KeyboardInterrupt:
        console.print("[red]sft interrupted: nothing written[/]")
        raise typer.Exit(130) from None
    return output
