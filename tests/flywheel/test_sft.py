"""The SFT stage (``trainer_service/sft.py``, ``flywheel sft``, ``stages``): the assistant-only mask on real chat
templates, the loss against a hand-written reference, a short fine-tune of the tiny model that learns its
demonstrations and writes a loadable folder, and the errors for bad data and bad ``stages``."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.config import FlywheelConfig
from shared.model import build_tiny_model, encode_chat, resolve_model_dir
from trainer_service.config import SftConfig, TrainerConfig
from trainer_service.sft import SftDataError, encode_row, length_batches, load_data, read_rows, run_sft, sft_loss

SMOLLM2_DIR = Path("~/.cache/flywheel/models/smollm2-135m-instruct").expanduser()

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]

ROWS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in [("2+2", "4"), ("3+5", "8"), ("1+6", "7"), ("9+0", "9")]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _runs(tok, enc) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    out, cur = [], []
    for i, m in zip(enc.ids, enc.mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [tok.decode(r) for r in out]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mask_is_the_assistant_turns_on_the_tiny_template(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    enc = encode_row(tok, CONVERSATION)
    assert _runs(tok, enc) == ["4\n", "It is 6.\n"]  # the content and the turn's end (a newline in this template)
    assert len(enc.ids) == len(enc.mask) and not enc.truncated
    assert tok.decode(enc.ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)


@pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").exists(), reason="SmolLM2 is not in the model cache")
def test_mask_is_the_assistant_turns_on_the_smollm2_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    enc = encode_row(tok, CONVERSATION)
    assert _runs(tok, enc) == ["4<|im_end|>", "It is 6.<|im_end|>"]  # not the headers, not the newline after


def test_mask_is_cut_with_the_row(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    full = encode_row(tok, CONVERSATION)
    cut = encode_row(tok, CONVERSATION, max_length=20)
    assert cut.truncated and cut.ids == full.ids[:20] and cut.mask == full.mask[:20]


def test_sft_loss_is_the_mean_cross_entropy_per_assistant_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (7,), generator=g)
    loss, metrics = sft_loss(logits, targets, 7)
    ref = -sum(torch.log_softmax(logits[i], -1)[targets[i]] for i in range(7)) / 7
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    assert metrics["loss/tokens"] == 7
    # micro-batches normalised by the step's tokens add up to the whole step's loss
    parts = sft_loss(logits[:3], targets[:3], 7)[0] + sft_loss(logits[3:], targets[3:], 7)[0]
    torch.testing.assert_close(parts, loss)


def test_length_batches_cover_every_row_once_in_similar_lengths():
    lengths = [random.Random(1).randint(1, 500) for _ in range(100)]
    batches = length_batches(lengths, 8, random.Random(0), chunk_batches=100)
    assert sorted(i for b in batches for i in b) == list(range(100))
    assert [len(b) for b in batches].count(8) == 12
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    assert spread < sum(lengths) / 4  # sorted in one chunk: far less than random batches' spread


def test_short_sft_learns_the_demonstrations_and_writes_a_loadable_folder(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = SftConfig(data=str(data), eval_data=str(data), epochs=40, lr=1e-2, batch_size=4, micro_batch_size=2,
                    log_every=20)
    lines: list[str] = []
    out = tmp_path / "sft" / "model"
    report = run_sft(tiny, cfg, TrainerConfig(autocast_bf16=False), out, emit=lines.append)
    epochs = report["epochs"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] / 4
    assert epochs[-1]["eval_loss"] < epochs[0]["eval_loss"] / 4
    assert json.loads((tmp_path / "sft" / "sft_report.json").read_text())["steps"] == 40
    assert sum(line.startswith("sft epoch") for line in lines) == 40 and any("tok/s" in x for x in lines)

    assert resolve_model_dir(str(out)) == out
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and (out / "generation_config.json").exists()
    for row in ROWS:
        prompt = torch.tensor([encode_chat(tok, row["messages"][:1])])
        answer = row["messages"][1]["content"] + "\n"  # the demonstration and its end of turn
        ids = model.generate(prompt, max_new_tokens=len(answer), do_sample=False, pad_token_id=tok.pad_token_id)
        assert tok.decode(ids[0, prompt.shape[1]:]) == answer
    with pytest.raises(FileExistsError, match="already holds a model"):
        run_sft(tiny, cfg, TrainerConfig(), out, emit=lines.append)


def test_rows_are_read_from_parquet_and_a_datasets_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**r, "tools": json.dumps([{"type": "function", "function": {"name": "add"}}])} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_rows(str(tmp_path / "d.parquet")) == rows
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert read_rows(str(tmp_path / "ds")) == rows


@pytest.mark.parametrize("rows, error", [
    ([ROWS[0], {"text": "hi"}], "sft.data row 2: no `messages` list"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "sft.data row 1: no assistant message"),
    ([{"messages": [{"role": "assistant", "content": "hi"}]}], "sft.data row 1: messages[0] is an assistant message"),
    ([{**ROWS[0], "tools": "{oops"}], "sft.data row 1: `tools` is text but not JSON"),
])
def test_bad_rows_are_named(tiny, tmp_path, rows, error):
    from transformers import AutoTokenizer

    cfg = SftConfig(data=str(_write_jsonl(tmp_path / "d.jsonl", rows)), eval_fraction=0)
    with pytest.raises(SftDataError, match=re.escape(error)):
        load_data(cfg, AutoTokenizer.from_pretrained(tiny))


def test_eval_split_is_seeded(tiny, tmp_path):
    from transformers import AutoTokenizer

    rows = ROWS * 10
    cfg = SftConfig(data=str(_write_jsonl(tmp_path / "d.jsonl", rows)), eval_fraction=0.1, seed=3)
    tok = AutoTokenizer.from_pretrained(tiny)
    a, b = load_data(cfg, tok), load_data(cfg, tok)
    assert (len(a.train), len(a.eval)) == (36, 4)
    assert [e.ids for e in a.eval] == [e.ids for e in b.eval]


def _config(tmp_path: Path, tiny: Path, **top) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({"model": {"name": str(tiny)}, "run": {"dir": str(tmp_path / "runs")}, **top}))
    return p


@pytest.mark.parametrize("data, error", [
    (None, "sft.data: '{missing}' does not exist"),
    ([ROWS[0], {"text": "hi"}], "sft.data row 2: no `messages` list"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "sft.data row 1: no assistant message"),
])
def test_cli_data_errors_exit_2_with_one_line(tiny, tmp_path, data, error):
    path = tmp_path / "missing.jsonl" if data is None else _write_jsonl(tmp_path / "d.jsonl", data)
    cfg = _config(tmp_path, tiny, sft={"data": str(path)})
    r = CliRunner().invoke(app, ["sft", str(cfg)])
    assert r.exit_code == 2, r.output
    assert error.format(missing=path) in r.output and "Traceback" not in r.output
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("config.json"))


@pytest.mark.parametrize("top, error", [
    ({"stages": ["ppo"]}, "stages.0: Input should be 'sft' or 'rl'"),
    ({"stages": ["sft"]}, "stages: sft needs an sft: section"),
    ({"stages": ["rl", "sft"], "sft": {"data": "x.jsonl"}}, "is not one of [rl], [sft], [sft, rl]"),
    ({"sft": {"data": "x.jsonl", "epoch": 2}}, "sft.epoch: Extra inputs are not permitted"),
])
def test_cli_config_errors_exit_2(tiny, tmp_path, top, error):
    r = CliRunner().invoke(app, ["run", str(_config(tmp_path, tiny, **top))])
    assert r.exit_code == 2, r.output
    assert error in r.output and r.output.count("invalid config") == 1


def test_an_output_folder_in_the_way_is_refused_before_training(tiny, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = _config(tmp_path, tiny, sft={"data": str(_write_jsonl(tmp_path / "d.jsonl", ROWS)), "output": str(out)})
    r = CliRunner().invoke(app, ["sft", str(cfg)])
    assert r.exit_code == 2 and "exists and is not an empty folder" in r.output and "Traceback" not in r.output, r.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and not list(tmp_path.glob("taken.tmp*"))


def test_sft_command_needs_the_section(tiny, tmp_path):
    r = CliRunner().invoke(app, ["sft", str(_config(tmp_path, tiny))])
    assert r.exit_code == 2 and "needs an sft: section" in r.output, r.output


def test_stages_validate():
    assert FlywheelConfig().stages == ["rl"]
    assert FlywheelConfig(stages=["sft", "rl"], sft={"data": "d.jsonl"}).sft.epochs == 1
    for bad in (["rl", "rl"], [], ["rl", "sft"]):
        with pytest.raises(ValidationError, match="is not one of"):
            FlywheelConfig(stages=bad, sft={"data": "d.jsonl"})


def test_run_with_the_sft_stage_only_writes_the_model_under_the_run_dir(tiny, tmp_path):
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = _config(tmp_path, tiny, stages=["sft"], sft={"data": str(data), "epochs": 2, "eval_fraction": 0.25},
                  trainer={"autocast_bf16": False})
    r = CliRunner().invoke(app, ["run", str(cfg)])
    assert r.exit_code == 0, r.output
    [out] = (tmp_path / "runs").glob("cfg-sft-*/model")
    report = json.loads((out.parent / "sft_report.json").read_text())
    assert (report["train_rows"], report["eval_rows"], len(report["epochs"])) == (3, 1, 2)
    assert report["eval_loss"] is not None and "sft epoch 2/2" in r.output and "rl stage" not in r.output


@pytest.mark.e2e
def test_run_sft_then_rl_starts_the_rl_run_from_the_sft_model(tiny, tmp_path):
    """``stages: [sft, rl]`` through the CLI: the SFT stage, then the RL run (five services, the embedded broker)
    with ``model.name`` the SFT folder, for two steps."""
    import subprocess
    import sys

    from flywheel.broker import die_with_parent

    root = Path(__file__).resolve().parents[2]
    cfg = yaml.safe_load((root / "examples/toy.yaml").read_text())
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg.update(stages=["sft", "rl"], sft={"data": str(data), "epochs": 2, "eval_fraction": 0})
    cfg.setdefault("model", {})["name"] = str(tiny)
    path = tmp_path / "sft_rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "run", str(path), "--set", "budget.max_steps=2",
                        "--set", f"run.dir={tmp_path / 'runs'}", "--report", str(report), "--timeout", "300"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=400, preexec_fn=die_with_parent())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [out] = (tmp_path / "runs").glob("sft_rl-sft-*/model")
    assert f"rl stage: model.name = {out}" in r.stdout
    rep = json.loads(report.read_text())
    assert rep["steps"] == 2 and rep["config"]["model"]["name"] == str(out)
