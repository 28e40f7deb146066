"""``flywheel export``: a trained policy version of a run as a plain Hugging Face model folder.

What a run directory holds and where this reads it from:

- the policy versions: the checkpoint store (``run.checkpoint_dir``, ``checkpoints/`` by default;
  :mod:`shared.checkpoint`), one ``vNNNNNN/`` per version with its ``update.json`` (a
  :class:`shared.schemas.WeightUpdate`) and either ``model.safetensors`` (full weights) or, with
  ``trainer.lora``, ``adapter_model.safetensors`` (LoRA adapters, :mod:`shared.lora`);
- the run's config: ``flywheel-config.json`` (:data:`RUN_CONFIG_FILE`), the root config as ``flywheel run``
  and ``flywheel up`` resolved it, written by :func:`flywheel.run_config.save_run_config` when the system starts (runs started
  before it was written have none: the model name then comes from ``update.json``, the domains from the
  registry);
- the held-out figures: the scheduler's registry (``flywheel-registry.db``, or the config's
  ``scheduler.database_url``), its eval rounds read with the scheduler's own queries
  (:class:`scheduler_service.reward_store.RewardTables`) on a read-only connection.

The export is always a full model: a LoRA version is merged into the base model's weights with
:func:`shared.lora.merge_weights`, which computes each adapted weight as the rollout's
:class:`shared.lora.AdapterApplier` does (``(W.float() + (alpha / r) · B A).to(W.dtype)``), so the exported
model's logits equal the rollout's for that version, bit for bit. The folder is written beside ``out``
under a temporary name and renamed at the end: a failed export leaves nothing half-written.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from scheduler_service.reward_store import RewardTables
from shared.checkpoint import ADAPTER_FILE, WEIGHTS_FILE, CheckpointStore, read_update
from shared.config import ModelConfig
from shared.model import SMOLLM2, resolve_model_dir
from shared.schemas import WeightUpdate, decode

from flywheel.run_config import RUN_CONFIG_FILE

REGISTRY_URL = "sqlite:///flywheel-registry.db"
"""The scheduler's registry when the run's config does not name another (``scheduler.database_url``)."""
DTYPES = ("float32", "bfloat16", "float16")
"""What ``--dtype`` accepts (torch dtype names)."""
HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""Model aliases of ``model.name`` and the Hugging Face Hub id the card's ``base_model`` gives for them."""
CARD_TAGS = ("flywheel", "reinforcement-learning", "grpo")
"""The model card's ``tags``."""
_SECRET_WORDS = frozenset({"token", "key", "apikey", "password", "passwd", "pwd", "secret", "credential",
                           "credentials"})
"""A config key with one of these among its words (split at ``_``, ``-``, ``.`` and case changes, any case) has its
value hidden in the model card, whatever section it is in (domain ``params`` are free-form): ``api_key``,
``hfToken``, ``sasl_plain_password``; not ``max_tokens``. The saved config leaves out the auth token already."""


class ExportError(ValueError):
    """The export cannot be made; the message is one line that says why (the CLI prints it, exit 2)."""


@dataclass(frozen=True)
class EvalRound:
    """One held-out eval round of the run (the scheduler's ``GET /v1/evals/{id}``, read from the registry)."""

    eval_round: int
    min_policy_version: int
    """The round scores the policy at this version or newer."""
    policy_versions: list[int]
    """The versions that produced the round's scored samples."""
    n: int
    """Held-out items in the round."""
    completed: int
    """Items with a score (infra errors left out)."""
    accuracy: float | None
    """correct / completed (greedy pass rate); None before any item is scored."""
    done: bool
    by_domain: dict[str, tuple[int, int]] = field(default_factory=dict)
    """``{domain: (correct, completed)}``."""


@dataclass(frozen=True)
class RunInfo:
    """What the run directory says about the run, for the model card."""

    run_id: str
    """The run directory's name (``<config name>-<date-time>`` for ``flywheel run``)."""
    config: dict[str, Any] | None
    """The saved root config (:data:`RUN_CONFIG_FILE`), None when the run directory has none."""
    domains: dict[str, dict[str, Any]]
    """The domains' configs: the saved config's ``domains``, else the registry's ``domains`` table."""
    tasks: dict[str, dict[str, int]]
    """``{domain: {split: tasks registered}}`` from the registry (empty without one)."""
    evals: list[EvalRound]
    """Every eval round the registry holds, oldest first (empty without one)."""
    registry: str
    """Where the figures came from, or why there are none (one phrase, for the card)."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    out: Path
    version: int
    step: int
    lora: bool
    """The version was a LoRA adapter, merged into the base weights."""
    base_model: Path
    """The base model's directory (config, generation config and tokenizer came from it)."""
    dtype: str
    files: list[str]
    """Names of the files in ``out``, sorted."""
    run: RunInfo


def load_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's saved config (JSON), or None when the run directory has none.

    Raises:
        ExportError: the file exists but is not a JSON object.
    """
    path = run_dir / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        cfg = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ExportError(f"{path} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{path} is not a JSON object")
    return cfg


def _section(cfg: dict[str, Any] | None, name: str) -> dict[str, Any]:
    value = (cfg or {}).get(name)
    return value if isinstance(value, dict) else {}


def store_dir(run_dir: Path, cfg: dict[str, Any] | None) -> Path:
    """The run's checkpoint store: the saved config's ``run.checkpoint_dir`` (absolute, or relative to the run
    directory, wherever it now is), else ``<run_dir>/checkpoints``."""
    sub = Path(os.path.expanduser(_section(cfg, "run").get("checkpoint_dir") or "checkpoints"))
    return sub if sub.is_absolute() else run_dir / sub


def pick_version(store: Path, version: int | None = None) -> WeightUpdate:
    """The WeightUpdate of ``version`` in the store at ``store`` (default: the newest published one), its
    ``path`` pointing into ``store`` (the run directory may have moved since it was written).

    Raises:
        ExportError: the store does not exist or holds no published version, or ``version`` is not in it
            (the message lists the versions that are).
    """
    if not store.is_dir():
        raise ExportError(f"no checkpoints in the run directory: {store} does not exist")
    versions = CheckpointStore(store).versions()  # the directory exists: the constructor creates nothing
    if not versions:
        raise ExportError(f"no checkpoints in the run directory: {store} holds no published version")
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise ExportError(f"version {version} is not in {store}; versions there: "
                          f"{', '.join(map(str, versions))}")
    d = store / f"v{version:06d}"
    try:
        update = decode((d / "update.json").read_bytes(), WeightUpdate)
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split())
        raise ExportError(f"version {version}: {d / 'update.json'} cannot be read: {why}") from None
    name = ADAPTER_FILE if update.adapter is not None else WEIGHTS_FILE
    if not (d / name).is_file():
        raise ExportError(f"version {version}: {d / name} is missing")
    return update.model_copy(update={"path": str(d / name)})


def base_model_dir(update: WeightUpdate, cfg: dict[str, Any] | None, override: str | os.PathLike | None) -> Path:
    """The run's base model as the services find it (:func:`shared.model.resolve_model_dir` of the config's
    ``model.name`` and ``model.cache_dir``; without a saved config, the name the version's ``update.json``
    records and the default cache), or ``override``.

    Raises:
        ExportError: no such model (a directory that is gone, the SmolLM2 package not installed).
    """
    model = _section(cfg, "model")
    name = str(override) if override is not None else (model.get("name") or update.model)
    try:
        return resolve_model_dir(name, model.get("cache_dir") or ModelConfig().cache_dir)
    except (FileNotFoundError, OSError) as e:
        raise ExportError(f"base model of the run not found: {' '.join(str(e).split())} "
                          "(give its directory with --base-model)") from None


def checkpoint_model(base_dir: Path, update: WeightUpdate, dtype: str = "float32"):
    """The base model (float32, eval mode, CPU) with ``update``'s weights: full weights loaded as the rollout
    loads them (:func:`shared.model_weights.load_weights_state`; tied tensors stay tied), or a LoRA adapter
    merged into the base weights (:func:`shared.lora.merge_weights`); then cast to ``dtype``.

    Raises:
        ValueError: the file's checksum differs from its record's, or the weights or adapter do not fit the
            base model (names, shapes, ranks).
        OSError: a file cannot be read.
    """
    import torch

    from shared.lora import merge_weights
    from shared.model import load_model
    from shared.model_weights import load_weights_state, snapshot_weights

    state = read_update(update)  # first: a corrupt file is refused before the model is built
    model = load_model(base_dir, "float32")
    origin = f"v{update.version}"
    if update.adapter is not None:
        state = merge_weights(snapshot_weights(model), state, update.adapter)
    load_weights_state(model, state, origin)
    if dtype != "float32":
        model.to(getattr(torch, dtype))
    return model


def checkpoint_dtype(update: WeightUpdate) -> str:
    """The dtype of a version's full weights (the most common floating dtype of its manifest); ``float32`` for
    a LoRA version (the merge is computed in float32 on the float32 base)."""
    if update.adapter is not None:
        return "float32"
    counts: dict[str, int] = {}
    for t in update.manifest:
        if t.dtype in DTYPES:
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "float32"


class _RegistryReader(RewardTables):
    """The scheduler's own eval-round queries (:class:`scheduler_service.reward_store.RewardTables`) on a read-only
    connection: the registry is never created, migrated or written."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def _one(self, sql: str, *args: Any) -> sqlite3.Row | None:
        return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        return self._db.execute(sql, args).fetchall()


def registry_path(run_dir: Path, cfg: dict[str, Any] | None) -> Path | None:
    """The run's registry file (``scheduler.database_url``, relative paths under the run directory), or None
    for a database that is not SQLite."""
    url = _section(cfg, "scheduler").get("database_url") or REGISTRY_URL
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        return None
    p = Path(os.path.expanduser(url[len(prefix):]))
    return p if p.is_absolute() else run_dir / p


def read_registry(path: Path | None) -> tuple[list[EvalRound], dict[str, dict[str, int]], dict[str, dict], str]:
    """Eval rounds, tasks per domain and split, domain configs, and where they came from, read from the
    registry at ``path`` without writing it. A registry that is missing or unreadable gives empty figures
    and says why (the card says so rather than invent numbers)."""
    if path is None:
        return [], {}, {}, "the run's registry is not an SQLite file"
    if not path.is_file():
        return [], {}, {}, f"no registry in the run directory ({path.name})"

    try:
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as e:
        return [], {}, {}, f"the registry {path.name} could not be read ({e})"
    try:
        db.row_factory = sqlite3.Row
        reader = _RegistryReader(db)
        evals = []
        for e in reader.eval_rounds():
            try:
                by_domain = reader.eval_accuracy_by_domain(e["eval_round"])
            except sqlite3.Error:  # a registry from before groups had a domain
                by_domain = {}
            evals.append(EvalRound(eval_round=e["eval_round"], min_policy_version=e["min_policy_version"],
                                   policy_versions=list(e["policy_versions"]), n=e["n"], completed=e["completed"],
                                   accuracy=e["accuracy"], done=bool(e["done"]), by_domain=by_domain))
        tasks: dict[str, dict[str, int]] = {}
        for r in db.execute("SELECT domain, split, COUNT(*) AS n FROM tasks GROUP BY domain, split ORDER BY 1, 2"):
            tasks.setdefault(r["domain"], {})[r["split"]] = r["n"]
        domains = {}
        try:
            for r in db.execute("SELECT domain, config FROM domains ORDER BY domain"):
                domains[r["domain"]] = orjson.loads(r["config"])
        except (sqlite3.Error, orjson.JSONDecodeError):  # a registry from before the domains table
            pass
        return evals, tasks, domains, f"the scheduler's registry ({path.name})"
    except sqlite3.Error as e:
        return [], {}, {}, f"the registry {path.name} could not be read ({' '.join(str(e).split())})"
    finally:
        db.close()


def run_info(run_dir: Path, cfg: dict[str, Any] | None) -> RunInfo:
    """What the model card says about the run (see :class:`RunInfo`)."""
    evals, tasks, reg_domains, source = read_registry(registry_path(run_dir, cfg))
    domains = _section(cfg, "domains") or reg_domains
    return RunInfo(run_id=run_dir.resolve().name, config=cfg, domains=domains, tasks=tasks, evals=evals,
                   registry=source)


def _secret(key: str) -> bool:
    """Whether config key ``key`` names a secret (:data:`_SECRET_WORDS`)."""
    words = re.split(r"[_\-.\s]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key))
    return any(w.lower() in _SECRET_WORDS for w in words)


def _redact(value: Any) -> Any:
    """``value`` with every secret-looking key's (non-null) value replaced by ``<redacted>``."""
    if isinstance(value, dict):
        return {k: "<redacted>" if v is not None and _secret(str(k)) else _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


USAGE = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
inputs = tokenizer.apply_chat_template([{"role": "user", "content": "..."}], add_generation_prompt=True,
                                       return_dict=True, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```"""
"""The model card's ``Use`` section."""


def _eval_lines(run: RunInfo, version: int) -> list[str]:
    """The card's held-out section: one row per eval round (the rounds ``version`` answered are marked), per
    domain too when there were several; or a sentence saying the run directory records none."""
    if not run.evals:
        return [f"No held-out figures: the run directory records no eval round ({run.registry})."]
    lines = [f"Greedy pass rate on the held-out split, per eval round, from {run.registry}. A round scores the "
             "policy at its minimum version or newer; the versions column lists those that answered.", "",
             "| round | min version | versions scored | items | scored | accuracy | finished |",
             "|---|---|---|---|---|---|---|"]
    for e in run.evals:
        mark = " (this export)" if version in e.policy_versions else ""
        lines.append(f"| {e.eval_round} | {e.min_policy_version} | {', '.join(map(str, e.policy_versions)) or '-'}"
                     f"{mark} | {e.n} | {e.completed} | {_pct(e.accuracy)} | {'yes' if e.done else 'no'} |")
    per_domain = [(e.eval_round, d, c, n) for e in run.evals for d, (c, n) in sorted(e.by_domain.items())]
    if len({d for _, d, _, _ in per_domain}) > 1:
        lines += ["", "| round | domain | correct | scored | accuracy |", "|---|---|---|---|---|"]
        lines += [f"| {r} | {d} | {c} | {n} | {_pct(c / n if n else None)} |" for r, d, c, n in per_domain]
    return lines


def _domain_lines(run: RunInfo) -> list[str]:
    """The card's domains section: the driver's task source, then each domain's generator or environment, weight
    and registered tasks."""
    lines = []
    tasks_cfg = _section(run.config, "tasks")
    if tasks_cfg:
        dataset = f" (`{tasks_cfg['dataset']}`)" if tasks_cfg.get("dataset") else ""
        lines.append(f"- tasks submitted by the driver: `{tasks_cfg.get('kind')}`{dataset}")
    for name in sorted(set(run.domains) | set(run.tasks)):
        d = run.domains.get(name) or {}
        env = d.get("environment") or {}
        src = d.get("generator") or env.get("id") or env.get("module") or env.get("path")
        counts = run.tasks.get(name, {})
        line = f"- `{name}`" + (f": `{src}`" if src else "")
        if isinstance(d.get("weight"), (int, float)):
            line += f", weight {d['weight']:g}"
        if counts:
            line += f"; {counts.get('train', 0)} training and {counts.get('eval', 0)} held-out tasks registered"
        lines.append(line)
    return lines or ["The run directory names no domain or task."]


def model_card(run: RunInfo, update: WeightUpdate, base_name: str, dtype: str) -> str:
    """The ``README.md`` of an export: YAML front matter (``base_model``, ``library_name``, ``tags``), then the
    run's id, the exported version and step, its held-out figures (or a sentence saying there are none), its
    domains and tasks, and its config (secrets redacted)."""
    front = {"base_model": HUB_IDS.get(base_name, base_name), "library_name": "transformers",
             "tags": list(CARD_TAGS)}
    a = update.adapter
    how = (f"a LoRA adapter (r {a.r}, alpha {a.alpha:g}, {len(a.target_modules)} modules) merged into the base "
           "weights" if a is not None else "full weights")
    if run.config is not None:
        config = [f"The run's resolved config (`{RUN_CONFIG_FILE}` in its run directory; secrets redacted):", "",
                  "```yaml", yaml.safe_dump(_redact(run.config), sort_keys=False).rstrip(), "```"]
    else:
        config = [f"The run directory holds no saved config (`{RUN_CONFIG_FILE}`: runs started before the driver "
                  "wrote it have none)."]
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {run.run_id}: policy version {update.version}", "",
        f"Post-trained with Flywheel (asynchronous GRPO over Kafka) from `{base_name}`.", "",
        f"- **Run**: `{run.run_id}`",
        f"- **Policy version**: {update.version} (trainer step {update.step})",
        f"- **Weights**: {how}, saved as {dtype}",
        f"- **Source checkpoint**: `v{update.version:06d}` (checksum `{update.checksum}`)", "",
        "## Held-out evaluation", "", *_eval_lines(run, update.version), "",
        "## Domains and tasks", "", *_domain_lines(run), "",
        "## Training config", "", *config, "",
        "## Use", "", USAGE, ""])


def _check_out(out: Path, force: bool, keep: list[Path], inside: list[Path] = ()) -> None:
    """Refuse an ``out`` that would overwrite something: a non-empty directory without ``force``, a file, a
    directory that is (or holds) one of ``keep`` (the run directory, the checkpoint store, the base model), or one
    inside one of ``inside`` (the checkpoint store, the base model: replacing a folder there destroys a version).

    Raises:
        ExportError: as above.
    """
    if not out.name or out.name in (".", ".."):
        raise ExportError(f"{out}: name the output directory itself (not '.' or a root)")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out} exists and is not a directory")
    resolved = out.resolve()
    for k in keep:
        if resolved == k.resolve() or resolved in k.resolve().parents:
            raise ExportError(f"{out} is or holds {k}: choose another output directory")
    for k in inside:
        if k.resolve() in resolved.parents:
            raise ExportError(f"{out} is inside {k}: choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} is not empty (--force replaces it)")


def _write(model, base_dir: Path, tmp: Path, card: str) -> None:
    """Write the model (``save_pretrained``: ``config.json``, ``generation_config.json``,
    ``model.safetensors``), the base model's tokenizer with its chat template and generation config, and the card."""
    from transformers import AutoTokenizer

    model.save_pretrained(tmp)
    if (base_dir / "generation_config.json").is_file():
        shutil.copyfile(base_dir / "generation_config.json", tmp / "generation_config.json")
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(tmp)
    (tmp / "README.md").write_text(card)


def export_checkpoint(run_dir: str | os.PathLike, out: str | os.PathLike, version: int | None = None,
                      force: bool = False, dtype: str | None = None,
                      base_model: str | os.PathLike | None = None) -> ExportResult:
    """Export one policy version of a run as a Hugging Face model folder at ``out`` (see the module docstring).

    Args:
        run_dir: the run directory (``checkpoints/vNNNNNN/`` under it, or the saved config's store).
        out: the folder to write; must not exist or be empty, unless ``force`` (then it is replaced whole).
        version: the policy version; default the newest published one in the store.
        dtype: ``float32``, ``bfloat16`` or ``float16``; default the checkpoint's (:func:`checkpoint_dtype`).
        base_model: the base model's directory (or ``model.name``), when the run's is gone or moved.

    Returns:
        What was written (:class:`ExportResult`).

    Raises:
        ExportError: the run directory, its checkpoints, the version or the base model cannot be found, ``out``
            is in the way, the saved config is malformed, or the checkpoint does not fit the base model.
        OSError: writing ``out`` failed (nothing of it is left).
    """
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not run_dir.is_dir():
        raise ExportError(f"no run directory {run_dir}")
    cfg = load_run_config(run_dir)
    store = store_dir(run_dir, cfg)
    _check_out(out, force, [run_dir, store], [store])
    update = pick_version(store, version)
    base_dir = base_model_dir(update, cfg, base_model)
    _check_out(out, force, [run_dir, store, base_dir], [store, base_dir])
    dtype = dtype or checkpoint_dtype(update)
    try:
        model = checkpoint_model(base_dir, update, dtype)
    except (ValueError, OSError) as e:
        raise ExportError(f"version {update.version} does not load into the base model {base_dir}: "
                          f"{' '.join(str(e).split())}") from None
    info = run_info(run_dir, cfg)
    base_name = str(base_model) if base_model is not None else (_section(cfg, "model").get("name") or update.model)
    card = model_card(info, update, base_name, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}.tmp")
    old = out.with_name(f".{out.name}.export-{os.getpid()}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write(model, base_dir, tmp, card)
        _check_out(out, force, [])  # again: something may have appeared meanwhile
        if out.is_dir() and any(out.iterdir()):
            os.replace(out, old)  # --force: the old folder goes only once the new one is in place
        os.replace(tmp, out)  # over a missing or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return ExportResult(out=out, version=update.version, step=update.step, lora=update.adapter is not None,
                        base_model=base_dir, dtype=dtype, files=sorted(p.name for p in out.iterdir()), run=info)
