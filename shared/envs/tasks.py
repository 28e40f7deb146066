"""Flywheel tasks from an environment's dataset rows: one task shape for the driver and the scheduler.

The driver (``tasks.kind: environment``, :mod:`flywheel.tasks`) and the scheduler (a domain with an
``environment``, :mod:`scheduler_service.generate`) both turn rows into tasks here, so a task of an environment
is the same whichever of them made it: verifier kind ``environment`` carrying the reference, the row's answer,
info and other columns; the environment's system prompt before the row's prompt; its tools and turns when it is
multi-turn.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any

import orjson

from shared.envs.api import Environment
from shared.envs.datasets import load_rows
from shared.envs.loading import EnvironmentRef


def norm_text(text: str) -> str:
    """``text`` lower-cased with whitespace collapsed: what makes two prompts the same prompt."""
    return re.sub(r"\s+", " ", text.strip().lower())


def _key(row: dict[str, Any]) -> str:
    return norm_text(row["prompt"][-1]["content"])


def environment_name(ref: EnvironmentRef, env_name: str | None) -> str:
    """The domain name of an environment's tasks: its own ``name``, else the id, module or file stem."""
    if env_name:
        return env_name
    if ref.id:
        return ref.id
    if ref.module:
        return ref.module.split(":")[0].rsplit(".", 1)[-1]
    return Path(ref.path.split(":")[0]).stem


def split_rows(env: Environment, eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(held_out, train)`` normalised rows of ``env``.

    The dataset's rows are shuffled with ``seed``; held-out rows are the first ``eval_size`` of ``env.eval_dataset``
    (split ``test`` of a datasets folder) when it has one, else the first ``eval_size`` shuffled dataset rows.
    Training rows are the rest, less any whose prompt (last message, :func:`norm_text`) is held out.

    Raises:
        shared.envs.DatasetError: a dataset cannot be read, or a row lacks its prompt or a mapped column (the
            message names the column and the columns the row has).
    """
    rows = load_rows(env.dataset, env.columns)
    random.Random(seed).shuffle(rows)
    if env.eval_dataset is not None:
        held = load_rows(env.eval_dataset, env.columns, split="test")[:eval_size]
    else:
        held, rows = rows[:eval_size], rows[eval_size:]
    seen = {_key(r) for r in held}
    return held, [r for r in rows if _key(r) not in seen]


def row_task(ref: EnvironmentRef, env: Environment, domain: str, row: dict[str, Any], split: str,
             samples_per_task: int | None = None, recipe: dict[str, Any] | None = None,
             difficulty: float = 0.0) -> dict[str, Any]:
    """The task body (``POST /v1/tasks`` shape) of one normalised ``row`` of ``env``.

    Args:
        ref: the reference the verifier and the rollout load ``env`` by (give it resolved: an absolute path).
        env: the loaded environment (its system prompt, tools and turns).
        domain: the task's domain; its id is ``<domain>-<split>-<sha1 of the prompt, 12 hex digits>``.
        row: a row as :func:`shared.envs.datasets.normalise_row` makes it.
        split: ``train`` or ``eval``.
        samples_per_task: K of the task (``None``: the task schema's default).
        recipe: a verifier recipe the task carries (``None``: none, the verifier service's applies).
        difficulty: the task's difficulty.
    """
    prompt = row["prompt"]
    if env.system_prompt and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": env.system_prompt}, *prompt]
    rest = {k: v for k, v in row.items() if k not in ("prompt", "question", "answer", "info")}
    verifier = {"kind": "environment", "environment": ref.model_dump(mode="json", exclude_none=True),
                "answer": row["answer"], "info": row["info"], "row": rest}
    if recipe is not None:
        verifier["recipe"] = recipe
    digest = hashlib.sha1(orjson.dumps(prompt)).hexdigest()[:12]
    task = {"task_id": f"{domain}-{split}-{digest}", "domain": domain, "prompt": prompt, "verifier": verifier,
            "split": split, "difficulty": difficulty, "metadata": {"environment": domain}}
    if samples_per_task is not None:
        task["samples_per_task"] = samples_per_task
    if env.multi_turn:
        task |= {"tools": [t.__name__ for t in env.tools], "max_turns": env.max_turns}
    return task
