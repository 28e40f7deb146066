"""``flywheel budget``: the trajectory arithmetic of a config, the per-trajectory costs of a report, the
command (a tiny-model pilot) and its refusals of bad input."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from typer.testing import CliRunner

from flywheel.budget.costs import Cost, history_costs
from flywheel.budget.estimate import budget_report, estimate
from flywheel.budget.pilot import Pilot, _summarise, all_tasks, greedy_target
from flywheel.budget.trajectories import (Counts, domain_shares, eval_round_versions, issued_training_groups,
                                          plan_counts, unsolved_probability)
from flywheel.cli import app
from flywheel.config import load_config

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples/arithmetic.yaml"
TOY = ROOT / "examples/toy.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from shared.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _tasks(domain: str, train: int, evals: int, k: int = 8) -> list[dict]:
    return ([{"domain": domain, "split": "eval", "samples_per_task": k} for _ in range(evals)]
            + [{"domain": domain, "split": "train", "samples_per_task": k} for _ in range(train)])


def test_eval_rounds_are_round_zero_each_eval_every_multiple_and_the_final_one():
    assert eval_round_versions(30, 5, True, True) == [0, 5, 10, 15, 20, 25, 30]  # arithmetic.yaml: 7 rounds
    assert eval_round_versions(30, 7, True, True) == [0, 7, 14, 21, 28, 30]  # the final round of `flywheel run`
    assert eval_round_versions(30, 0, False, True) == [30]
    assert eval_round_versions(30, 5, True, False) == []  # no held-out tasks: no rounds


def test_issued_groups_round_the_oversampled_batch_up():
    assert issued_training_groups(4, 1.0, 30) == 120
    assert issued_training_groups(4, 1.5, 30) == 180
    assert issued_training_groups(3, 1.1, 10) == 40  # ⌈3.3⌉ = 4 per step


def test_unsolved_probability_is_unbiased_from_enough_samples_and_plug_in_below():
    assert unsolved_probability(0, 8, 8) == 1.0
    assert unsolved_probability(1, 8, 8) == 0.0
    assert unsolved_probability(2, 16, 8) == pytest.approx(3003 / 12870)  # C(14, 8) / C(16, 8)
    assert unsolved_probability(1, 4, 8) == pytest.approx(0.75 ** 8)
    with pytest.raises(ValueError):
        unsolved_probability(3, 2, 8)


def _row(task, passed, tokens, logprob=-30.0, resample=False, split="train"):
    return {"domain": "a", "split": split, "task_id": task, "tokens": tokens, "rounds": 1, "tool_rounds": 0,
            "tool_seconds": 0.0, "sandbox_seconds": 0.0, "judge_calls": 0.0, "truncated": tokens >= 24,
            "passed": passed, "logprob": logprob, "resample": resample}


def test_the_pilot_summary_counts_never_solved_tasks_through_their_re_sample_and_the_greedy_answer():
    cfg = load_config(ARITH)  # K = 8
    rows = ([_row("t1", i < 3, 24 if i == 2 else 8 if i < 2 else 20, -40.0 if i == 2 else -5.0 - i) for i in range(8)]
             + [_row("t2", False, 24) for _ in range(8)] + [_row("t2", i == 0, 20, resample=True) for i in range(24)]
             + [_row("t3", False, 24) for _ in range(8)] + [_row("t3", False, 22, resample=True) for _ in range(24)]
             + [_row("e1", False, 24, split="eval")])
    pilot = Pilot()
    _summarise(pilot, rows, cfg, None)
    assert pilot.unsolved["a"] == pytest.approx(2 / 3)  # t2 and t3 failed their 8 samples
    assert pilot.never_solved["a"] == pytest.approx(1 / 3)  # t3 failed its re-sample of 24 too
    assert pilot.train["a"].tokens == pytest.approx((2 * 8 + 24 + 5 * 20 + 16 * 24) / 24)  # the K-sample groups only
    assert pilot.resample["a"].tokens == pytest.approx(21.0) and pilot.resample["a"].source == "pilot re-samples"
    assert pilot.eval["a"].tokens == 24
    assert pilot.greedy_tokens["a"] == 8  # t1's most probable passing answer (t2's pass is in a re-sample)
    assert greedy_target([_row("x", True, 5, -9.0), _row("x", True, 9, -3.0), _row("y", True, 3, -1.0),
                            _row("y", False, 1, 0.0)]) == (9 + 3) / 2


def test_arithmetic_trajectories_match_the_hand_count():
    cfg = load_config(ARITH)  # 30 steps x 4 groups x K=8, re-samples of 24, eval 64 tasks every 5 versions
    counts = plan_counts(cfg, _tasks("basic_arithmetic", 128, 64), {"basic_arithmetic": 0.25})
    c = counts["basic_arithmetic"]
    assert (c.train_groups, c.train_samples) == (120, 960)
    assert (c.resample_groups, c.resample_trajectories) == (30, 720)  # 120 x 0.25 groups of 24
    assert (c.eval_rounds, c.eval_trajectories) == (7, 448)
    over = plan_counts(load_config(ARITH, budget={"oversample": 1.5, "resample_unsolved": 8}),
                         _tasks("basic_arithmetic", 128, 64), {"basic_arithmetic": 0.25})["basic_arithmetic"]
    assert over.train_samples == 180 * 8 and over.resample_trajectories == 0  # a re-sample must be larger than K


def test_domains_share_the_groups_by_weight_and_paused_ones_get_none():
    shares = domain_shares(["a", "b", "c"], {"a": SimpleNamespace(weight=3.0, state="active"),
                                               "c": SimpleNamespace(weight=5.0, state="paused")})
    assert shares == {"a": 0.75, "b": 0.25, "c": 0.0}
    with pytest.raises(ValueError, match="weight 0"):
        domain_shares(["a"], {"a": SimpleNamespace(weight=0.0, state="active")})


def test_a_generator_domain_gets_its_weighted_share_and_its_held_out_tasks():
    cfg = load_config(TOY, domains={"geo": {"generator": "flywheel.domains.geometry", "eval_size": 3, "weight": 3}})
    tasks = all_tasks(cfg, 2)  # toy's 64 + 16, and the generator's 2 pilot tasks + 3 held-out ones
    assert sum(t["domain"] == "geo" for t in tasks) == 5
    counts = plan_counts(cfg, tasks)
    assert counts["geo"].train_groups == 75 and counts["toy_prefix"].train_groups == 25  # 100 groups, weights 3 : 1
    assert (counts["geo"].eval_trajectories, counts["toy_prefix"].eval_trajectories) == (3 * 2, 16 * 2)


@pytest.mark.parametrize("never, resampled, resample_tokens", [
    (0.0, 120 * 0.45 / 9, 22 - 12 / 10),  # all learnable: unsolved 0.45 / (K + 1), re-sampled early (t = 1 / (K + 2))
    (0.45, 120 * 0.45, 22 - 12 / 2),  # never solved in the pilot: unsolved throughout, re-sampled evenly (t = 1/2)
])
def test_the_pilot_estimate_assumes_even_paced_learning_towards_the_rewarded_lengths(never, resampled, resample_tokens):
    cfg = load_config(ARITH)  # K = 8, re-samples of 24, 120 groups, eval rounds at 0, 5, ..., 30 (mean progress 1/2)
    pilot = Pilot(train={"a": Cost(tokens=20.0, pass_tokens=10.0)}, eval={"a": Cost(tokens=24.0)},
                    resample={"a": Cost(tokens=22.0)}, unsolved={"a": 0.45}, never_solved={"a": never})
    rep = budget_report(cfg, _tasks("a", 128, 64), pilot)
    assert rep["range"]["no_learning"]["generated_tokens"] == 960 * 20 + 120 * 0.45 * 24 * 22 + 448 * 24
    assert rep["range"]["learned"]["generated_tokens"] == (960 + 448) * 10  # no re-samples, rewarded lengths
    # even pace: training at 15 tokens (halfway from 20 to 10), eval at 17 (halfway from 24)
    assert rep["estimate"]["total"]["generated_tokens"] == pytest.approx(
        960 * 15 + 448 * 17 + resampled * 24 * resample_tokens)
    assert rep["counts"]["a"]["resample_trajectories"] == pytest.approx(resampled * 24)


def test_the_estimate_is_trajectories_times_rounds_times_tokens_per_round():
    counts = {"d": Counts(train_groups=10, samples_per_task=4, resample_groups=2, resample_samples=8, eval_tasks=5,
                            eval_rounds=3)}
    train = {"d": Cost(tokens=30.0, rounds=3.0, tool_rounds=2.0, sandbox_seconds=0.5, judge_calls=1.0)}
    resample = {"d": Cost(tokens=60.0, rounds=3.0)}
    est = estimate(counts, train, {"d": Cost(tokens=12.0)}, resample)
    tr, ev = est["rows"]
    assert tr["trajectories"] == 56 and tr["generated_tokens"] == 40 * 3 * 10 + 16 * 3 * 20
    assert tr["tool_rounds"] == 40 * 2 + 0 and tr["judge_calls"] == 40
    assert ev["trajectories"] == 15 and ev["generated_tokens"] == 180
    assert est["total"]["generated_tokens"] == tr["generated_tokens"] + 180


def _report(tmp_path: Path, **extra) -> Path:
    rep = {"config": {"budget": {"batch_groups": 4, "oversample": 1.0, "max_steps": 2}},
           "history": [{"step": 1, "train/response_len": 10.0, "train/samples": 32.0, "train/superseded_unsolved_total": 1},
                       {"step": 2, "train/response_len": 20.0, "train/samples": 32.0, "train/superseded_unsolved_total": 2}],
           **extra}
    p = tmp_path / "report.json"
    p.write_bytes(orjson.dumps(rep))
    return p


def test_history_takes_the_reports_cost_or_else_the_trained_samples(tmp_path):
    cost = {"train": {"samples": 100, "generated_tokens": 1500, "tool_rounds": 0, "tool_seconds": 0.0,
                      "sandbox_seconds": 0.0, "judge_calls": 0},
            "eval": {"samples": 10, "generated_tokens": 50}}
    h = history_costs(_report(tmp_path, cost=cost))
    assert h["costs"]["train"].tokens == 15.0 and h["costs"]["eval"].tokens == 5.0 and h["source"] == "history:cost"
    assert h["unsolved"] == pytest.approx(2 / 8)
    old = history_costs(_report(tmp_path))  # a report from before `cost`: the trainer's per-step history
    assert old["costs"]["train"].tokens == 15.0 and "eval" not in old["costs"]
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a flywheel run report"):
        history_costs(tmp_path / "bad.json")


def test_budget_from_history_prints_json_with_its_source(tmp_path):
    rep = _report(tmp_path, cost={"train": {"samples": 100, "generated_tokens": 1500},
                                  "eval": {"samples": 10, "generated_tokens": 50}})
    r = CliRunner().invoke(app, ["budget", str(TOY), "--history", str(rep), "--json"])
    assert r.exit_code == 0, r.output
    out = orjson.loads(r.stdout)
    assert out["method"] == "history (history:cost)" and "pilot" not in out
    tr, ev = out["estimate"]["rows"]
    assert tr["trajectories"] == 25 * 4 * 8 and tr["tokens_per_trajectory"] == 15.0  # toy: no re-samples
    assert ev["trajectories"] == 16 * 2 and ev["generated_tokens"] == 16 * 2 * 5.0
    table = CliRunner().invoke(app, ["budget", str(TOY), "--history", str(rep)])
    assert table.exit_code == 0 and "generated tokens" in table.stdout and "12,160" in table.stdout  # 12,000 + 160
    assert f"history: {rep}" in table.stdout


def test_budget_pilot_with_a_tiny_model_reports_every_field(tiny):
    r = CliRunner().invoke(app, ["budget", str(TOY), "--set", f"model.name={tiny}", "--set", "budget.max_steps=3",
                                 "--set", "budget.resample_unsolved=12", "--pilot-tasks", "4", "--json"])
    assert r.exit_code == 0, r.output
    out = orjson.loads(r.stdout)
    assert out["plan"]["training_groups"] == 12 and out["plan"]["eval_round_versions"] == [0, 3]
    assert out["pilot"]["tasks"] == {"train": 4, "eval": 4} and out["pilot"]["seconds"] > 0
    tr, ev = out["estimate"]["rows"]
    assert (tr["split"], ev["split"], ev["trajectories"]) == ("train", "eval", 32)
    assert tr["trajectories"] == pytest.approx(96 + tr["resample_trajectories"])  # 12 groups of 8, + re-samples
    assert 0 < tr["tokens_per_trajectory"] <= 4 and tr["rounds"] == 1.0  # toy.yaml: max_tokens 4, no tools
    assert out["estimate"]["total"]["generated_tokens"] == pytest.approx(tr["generated_tokens"] + ev["generated_tokens"])
    assert set(out["range"]) == {"no_learning", "learned"} and out["method"] == "pilot, even-pace learning"
    unsolved = out["pilot"]["unsolved"]["toy_prefix"]  # the tiny model's groups, re-sampled when unsolved
    assert 0 <= out["pilot"]["never_solved"]["toy_prefix"] <= unsolved
    if unsolved:
        assert out["pilot"]["resample"]["toy_prefix"]["source"] == "pilot re-samples"


@pytest.mark.parametrize("args, message", [
    (["budget", "no/such.yaml"], "does not exist"),
    (["budget", str(TOY), "--set", "max_steps=3"], "is not section.field=value"),
    (["budget", str(TOY), "--set", "budget.max_steps=none", "--pilot-tasks", "0"], "max_steps"),
    (["budget", str(TOY), "--pilot-tasks", "0"], "run the pilot or give --history"),
])
def test_bad_input_exits_non_zero_with_a_clear_message(args, message):
    r = CliRunner().invoke(app, args)
    text = " ".join(r.output.replace("│", " ").split())  # typer boxes and wraps the message
    assert r.exit_code != 0 and message in text, r.output


def test_history_and_pilot_together_take_the_lengths_from_the_history(tiny, tmp_path):
    rep = _report(tmp_path)  # a report from before `cost`: train lengths from the history, eval from the pilot
    r = CliRunner().invoke(app, ["budget", str(TOY), "--set", f"model.name={tiny}", "--history", str(rep),
                                 "--pilot-tasks", "1"])
    assert r.exit_code == 0, r.output
    assert "history (history:train_steps)" in r.stdout and "pilot:" in r.stdout and "eval tokens from the pilot" in r.stdout
