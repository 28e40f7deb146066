"""``flywheel export``: a run's policy version comes out as a Hugging Face folder whose logits equal the rollout's
for that version (full weights, and a LoRA adapter merged into the base), with a model card naming the version and
the run's held-out figures; every way it cannot be made is one line on stderr, exit 2, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.config import load_config
from flywheel.export import export_checkpoint
from flywheel.run_config import RUN_CONFIG_FILE, save_run_config
from rollout_service.torch_engine import TorchEngine
from scheduler_service.registry import Registry
from shared import lora
from shared.checkpoint import CheckpointStore
from shared.model import build_tiny_model, load_model, load_tokenizer
from shared.model_weights import snapshot_weights
from shared.schemas import RewardEvent, Task, WeightUpdate

IDS = torch.tensor([[1, 40, 41, 42, 5, 6, 7, 8]])
TOKEN = "s3cret-token-of-the-run-0123456789"


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits


def _rollout_logits(base: Path, update: WeightUpdate) -> torch.Tensor:
    """The logits of ``update`` as a rollout engine serves it (the base it loads at start, then the version)."""
    engine = TorchEngine(load_model(base), load_tokenizer(base))
    engine.update_weights(update)
    return _logits(engine.model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("export") / "tiny")


def _eval_task(tid: str) -> Task:
    return Task(task_id=tid, domain="toy", prompt=[{"role": "user", "content": tid}],
                verifier={"kind": "exact", "answer": "a"}, samples_per_task=2, split="eval")


def _record_eval_round(reg: Registry, min_version: int, version: int, passed: list[bool]) -> None:
    """One eval round at ``min_version``, its items answered by ``version`` with ``passed`` (the scheduler's path)."""
    rid = reg.create_eval_round(min_version)
    groups = sorted((g for g in reg.take_pending(60, purpose="eval") if g.eval_round == rid), key=lambda g: g.group_id)
    for g, ok in zip(groups, passed, strict=True):
        reg.record_reward(RewardEvent(task_id=g.task.task_id, group_id=g.group_id, trajectory_id=f"{g.group_id}:0",
                                      sample_index=0, group_size=1, domain="toy", difficulty=0.0, purpose="eval",
                                      reward=float(ok), passed=ok, infra_error=False, completion_tokens=3,
                                      finish_reason="stop", policy_version=version))


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory) -> tuple[Path, dict[int, WeightUpdate]]:
    """A run of three full-weight versions (each the base plus its own noise), its saved config (with an auth token)
    and a registry holding two eval rounds: accuracy 0.5 at version 0 and 1.0 at version 3."""
    run_dir = tmp_path_factory.mktemp("runs") / "arith-20261208-011600"
    store = CheckpointStore(run_dir / "checkpoints", keep=5)
    updates = {}
    for v in (1, 2, 3):
        torch.manual_seed(v)
        model = load_model(tiny)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        updates[v] = store.save(snapshot_weights(model), str(tiny), v, 10 * v, {"step": 10 * v, "optimizer": None})
    cfg = load_config(None, model={"name": str(tiny)}, auth={"token": TOKEN}, budget={"max_steps": 3})
    save_run_config(run_dir, cfg)
    reg = Registry(run_dir / "flywheel-registry.db")
    try:
        reg.register_tasks([_eval_task("e1"), _eval_task("e2")])
        _record_eval_round(reg, 0, 0, [True, False])
        _record_eval_round(reg, 3, 3, [True, True])
    finally:
        reg.close()
    return run_dir, updates


@pytest.fixture(scope="module")
def lora_run(tiny, tmp_path_factory) -> tuple[Path, WeightUpdate]:
    """A LoRA run (no saved config, no registry: a run directory from before either) with one adapter version whose
    B matrices are non-zero, so the merge changes the model."""
    run_dir = tmp_path_factory.mktemp("runs") / "lora-run"
    model = load_model(tiny)
    info = lora.inject(model, r=4, alpha=8.0, target_modules="all-linear")
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn_like(p) * 0.1)
    state = lora.adapter_state(model, info, copy=True)
    update = CheckpointStore(run_dir / "checkpoints").save(state, str(tiny), 1, 1, None, adapter=info)
    return run_dir, update


def _export(*args: str):
    r = CliRunner().invoke(app, ["export", *map(str, args)])
    return r


def _siblings(out: Path) -> list[str]:
    """Entries beside ``out`` that an export's temporary folders would leave."""
    return sorted(p.name for p in out.parent.iterdir() if ".export-" in p.name)


def test_a_full_weights_version_exports_with_equal_logits_and_the_newest_by_default(tiny, full_run, tmp_path):
    run_dir, updates = full_run
    out = tmp_path / "hf"
    result = export_checkpoint(run_dir, out)
    assert (result.version, result.step, result.lora, result.dtype) == (3, 30, False, "float32")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert next(exported.parameters()).dtype == torch.float32
    got = _logits(exported)
    assert torch.equal(got, _rollout_logits(tiny, updates[3]))
    assert not torch.allclose(got, _rollout_logits(tiny, updates[2]), atol=1e-3)  # the newest, not another
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "tokenizer.json",
            "tokenizer_config.json"} <= set(result.files)
    # tied embeddings as the base has them: one tensor stored, the output layer tied to it
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(tiny / "model.safetensors")))
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    tok, base_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny)
    assert tok.chat_template and tok.chat_template == base_tok.chat_template
    msgs = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == base_tok.apply_chat_template(msgs, tokenize=False)
    assert _siblings(out) == []


def test_version_picks_an_older_one(tiny, full_run, tmp_path):
    run_dir, updates = full_run
    out = tmp_path / "v1"
    r = _export(run_dir, out, "--version", "1")
    assert r.exit_code == 0, r.output
    assert "exported policy version 1 (step 10" in r.stdout
    got = _logits(AutoModelForCausalLM.from_pretrained(out))
    assert torch.equal(got, _rollout_logits(tiny, updates[1]))
    assert not torch.allclose(got, _rollout_logits(tiny, updates[3]), atol=1e-3)


def test_a_lora_version_is_merged_into_a_plain_full_model(tiny, lora_run, tmp_path):
    run_dir, update = lora_run
    out = tmp_path / "merged"
    result = export_checkpoint(run_dir, out)
    assert result.lora and result.version == 1
    assert "adapter_model.safetensors" not in result.files and "adapter_config.json" not in result.files
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not hasattr(exported, "peft_config")
    got = _logits(exported)
    assert torch.equal(got, _rollout_logits(tiny, update))
    assert not torch.allclose(got, _logits(load_model(tiny)), atol=1e-3)  # the adapter did change the model
    card = (out / "README.md").read_text()
    assert "LoRA adapter (r 4, alpha 8, 14 modules) merged" in card
    assert "No held-out figures" in card and f"holds no saved config (`{RUN_CONFIG_FILE}`" in card


def test_the_model_card_names_the_version_the_figures_and_the_config(tiny, full_run, tmp_path):
    run_dir, _ = full_run
    out = tmp_path / "card"
    export_checkpoint(run_dir, out, version=3)
    card = (out / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    assert yaml.safe_load(front) == {"base_model": str(tiny), "library_name": "transformers",
                                     "tags": ["flywheel", "reinforcement-learning", "grpo"]}
    assert "# arith-20261208-011600: policy version 3" in body
    assert "**Policy version**: 3 (trainer step 30)" in body
    rows = [line for line in body.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert rows == ["| 0 | 0 | 0 | 2 | 2 | 0.500 | yes |", "| 1 | 3 | 3 (this export) | 2 | 2 | 1.000 | yes |"]
    assert "`toy`" in body and "0 training and 2 held-out tasks registered" in body
    config = yaml.safe_load(body.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert config["model"]["name"] == str(tiny) and config["budget"]["max_steps"] == 3
    assert TOKEN not in card and TOKEN not in (run_dir / RUN_CONFIG_FILE).read_text()


def test_force_replaces_a_non_empty_folder(full_run, tmp_path):
    run_dir, _ = full_run
    out = tmp_path / "taken"
    out.mkdir()
    (out / "old.txt").write_text("old")
    r = _export(run_dir, out, "--force", "--version", "2")
    assert r.exit_code == 0, r.output
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert _siblings(out) == []


def _one_line_exit_2(r, *says: str) -> None:
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.output, r.output
    for s in says:
        assert s in err, err


def test_errors_are_one_line_exit_2_and_write_nothing(full_run, tmp_path):
    run_dir, _ = full_run
    out = tmp_path / "out"
    _one_line_exit_2(_export(tmp_path / "nope", out), "no run directory", "nope")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    _one_line_exit_2(_export(empty, out), "no checkpoints")
    assert not (empty / "checkpoints").exists()  # looking did not create the store
    _one_line_exit_2(_export(run_dir, out, "--version", "9"), "version 9 is not in", "versions there: 1, 2, 3")
    _one_line_exit_2(_export(run_dir, out, "--dtype", "int8"), "float32, bfloat16, float16")
    _one_line_exit_2(_export(run_dir, run_dir.parent, "--force"), "choose another output directory")
    assert not out.exists() and _siblings(out) == []
    published = run_dir / "checkpoints" / "v000002"
    before = sorted(p.name for p in published.iterdir())
    _one_line_exit_2(_export(run_dir, published, "--force"), "is inside", "choose another output directory")
    assert sorted(p.name for p in published.iterdir()) == before  # a published version is never replaced
    _one_line_exit_2(_export(run_dir, Path(".")), "name the output directory itself")


def test_the_model_card_hides_secret_looking_keys_in_any_section():
    from flywheel.export import _redact

    cfg = {"domains": {"judged": {"params": {"openai_api_key": "sk-1", "hfToken": "hf_x", "n": 3}}},
           "kafka": {"sasl_plain_password": "pw"}, "scheduler": {"max_tokens": 24}}
    assert _redact(cfg) == {"domains": {"judged": {"params": {"openai_api_key": "<redacted>", "hfToken": "<redacted>",
                                                              "n": 3}}},
                            "kafka": {"sasl_plain_password": "<redacted>"}, "scheduler": {"max_tokens": 24}}


def test_a_refused_export_leaves_out_untouched(full_run, tmp_path):
    run_dir, _ = full_run
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    _one_line_exit_2(_export(run_dir, out), "is not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert _siblings(out) == []


def test_a_corrupt_checkpoint_is_refused_without_writing(tiny, tmp_path):
    run_dir = tmp_path / "run"
    update = CheckpointStore(run_dir / "checkpoints").save(snapshot_weights(load_model(tiny)), str(tiny), 1, 1, None)
    path = Path(update.path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    _one_line_exit_2(_export(run_dir, out), "version 1 does not load", "checksum")
    assert not out.exists() and _siblings(out) == []
