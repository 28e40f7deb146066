"""User environments' reward functions in the verifier: scores, metrics, and every way a reward can fail
(raises, NaN, a string, out of range, never returns, cannot be imported) is an infrastructure error, never 0;
a stuck reward holds up only its own environment."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from shared.verifier_specs import EnvironmentSpec, VerifierSpec
from verifier_service.config import VerifierConfig
from verifier_service.main import environment_metrics
from verifier_service.scorers import Scorer

ENV = str(Path(__file__).resolve().parents[1] / "support" / "envs" / "behaviours.py")


def spec(behaviour: str = "exact", answer=4, path: str = ENV, **info) -> EnvironmentSpec:
    return TypeAdapter(VerifierSpec).validate_python(
        {"kind": "environment", "environment": {"path": path, "args": {"behaviour": behaviour}}, "answer": answer,
         "info": info, "recipe": {"reason": "no truncation gate: these tests score the rubric alone"}})


@pytest.fixture
async def scorer():
    s = Scorer(VerifierConfig(reward_timeout_s=3.0, reward_workers=1))
    yield s
    await s.close()


async def test_a_rubric_scores_its_weighted_mean_and_reports_each_function_and_metric(scorer):
    right = await scorer.score(spec(), "4", prompt=[{"role": "user", "content": "2+2"}])
    assert right.total == 1.0 and right.passed and not right.infra_error
    assert environment_metrics(right.details) == {"exact": 1.0, "misbehaving": 1.0, "misbehaving.length": 1.0}
    wrong = await scorer.score(spec(), "5")
    assert wrong.total == 0.0 and not wrong.infra_error
    graded = await scorer.score(spec(graded=True), "5")  # the async reward applies: (0 + 0 + 0.5 * 1) / 2.5
    assert graded.total == pytest.approx(0.2) and environment_metrics(graded.details)["not_applicable"] == 1.0


@pytest.mark.parametrize("behaviour, says", [("raises", "raised KeyError"), ("nan", "returned nan"),
                                             ("string", "returned str"), ("out_of_range", "outside [0, 1]")])
async def test_a_reward_that_fails_is_an_infrastructure_error_not_a_zero(scorer, behaviour, says):
    r = await scorer.score(spec(behaviour), "4")
    assert r.infra_error and not r.passed and says in r.details["reason"], r.details
    assert not r.details.get("misconfigured")  # retried like any infrastructure failure


async def test_a_reward_that_never_returns_times_out_and_the_next_call_works(scorer):
    t0 = time.monotonic()
    stuck = await scorer.score(spec("sleeps"), "4")
    assert stuck.infra_error and "exceeded 3.0 s" in stuck.details["reason"]
    assert time.monotonic() - t0 < 30
    again = await scorer.score(spec("sleeps"), "5")  # a fresh pool: the stuck process was killed
    assert again.infra_error and "exceeded" in again.details["reason"]


async def test_a_stuck_environment_does_not_hold_up_another():
    scorer = Scorer(VerifierConfig(reward_timeout_s=300.0, reward_workers=1))
    try:
        stuck = asyncio.create_task(scorer.score(spec("sleeps"), "4"))
        await asyncio.sleep(0.5)
        other = await scorer.score(spec("exact"), "4")  # its own pool starts and scores while the other hangs
        assert other.total == 1.0 and not stuck.done()
        stuck.cancel()
    finally:
        await scorer.close()


@pytest.mark.parametrize("path, says", [("/nonexistent/env.py", "is not a file"),
                                        (f"{ENV}:no_such_function", "has no attribute 'no_such_function'")])
async def test_an_environment_that_cannot_load_is_misconfigured_and_named(scorer, path, says):
    r = await scorer.score(spec(path=path), "4")
    assert r.infra_error and r.details.get("misconfigured") and says in r.details["reason"], r.details
    assert path.split(":")[0] in r.details["reason"]


STATEFUL = '''
from flywheel.env import Environment


def won(completion, state, tool_calls, turns):
    return {"score": float(state.get("won", False) and completion == "final answer"),
            "calls": len(tool_calls), "turns": len(turns)}


def load_environment():
    return Environment(dataset=[{"question": "q"}], rubric=[won])
'''


async def test_a_multi_turn_rollout_gives_its_state_calls_and_last_turn_to_the_rewards(scorer, tmp_path):
    from shared.schemas import Task, Trajectory
    from verifier_service.main import rollout_context

    path = tmp_path / "stateful.py"
    path.write_text(STATEFUL)
    task = Task(task_id="t", domain="d", prompt=[{"role": "user", "content": "q"}], max_turns=2, tools=["add"],
                verifier={"kind": "environment", "environment": {"path": str(path)},
                          "recipe": {"reason": "no truncation gate: the test scores the rubric alone"}})
    turns = [{"role": "assistant", "start": 0, "end": 1, "text": "call"},
             {"role": "tool", "start": 1, "end": 2, "text": "5", "tool_calls": [{"name": "add", "arguments": {}}]},
             {"role": "assistant", "start": 2, "end": 3, "text": "final answer"}]
    traj = Trajectory(trajectory_id="g:1:0", group_id="g", sample_index=0, group_size=1, task=task, prompt_ids=[1],
                      completion_ids=[1, 2, 3], completion_logprobs=[-1.0, 0.0, -1.0], loss_mask=[1, 0, 1],
                      completion_text="call 5 final answer", finish_reason="stop", turns=turns, state={"won": True},
                      policy_versions=[{"version": 0, "start": 0, "end": 3}])
    r = await scorer.score(task.verifier, traj.completion_text, rollout=rollout_context(traj))
    assert r.total == 1.0 and environment_metrics(r.details) == {"won": 1.0, "won.calls": 1.0, "won.turns": 3.0}
    lost = await scorer.score(task.verifier, traj.completion_text,
                              rollout=rollout_context(traj.model_copy(update={"state": {"won": False}})))
    assert lost.total == 0.0 and not lost.infra_error


BATCHED = '''
import os
import time

from flywheel.env import Environment


def reward(completion: str, answer) -> dict:
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(3)
    if completion == "slow":
        time.sleep(1.2)
    return {"score": float(completion == str(answer)), "length": len(completion)}


def load_environment(**args):
    return Environment(dataset=[{"question": "q", "answer": "44"}], rubric=[reward])
'''


def batched(tmp_path, answer="44") -> EnvironmentSpec:
    path = tmp_path / "batched.py"
    path.write_text(BATCHED)
    return spec(path=str(path), answer=answer)


@pytest.mark.parametrize("batch_size, wait_ms", [(16, 0.0), (64, 2.0)])
async def test_concurrent_calls_are_batched_and_each_gets_its_own_result(tmp_path, batch_size, wait_ms):
    scorer = Scorer(VerifierConfig(reward_workers=2, reward_batch_size=batch_size, reward_batch_wait_ms=wait_ms))
    try:
        env = batched(tmp_path)
        completions = ["4" * (i % 7 + 1) for i in range(100)]  # 100 calls over two workers, several per message
        results = await asyncio.gather(*(scorer.score(env, c) for c in completions))
        for c, r in zip(completions, results):
            assert not r.infra_error and r.total == float(c == "44"), (c, r)
            assert environment_metrics(r.details)["reward.length"] == len(c)
    finally:
        await scorer.close()


@pytest.mark.parametrize("batch_size", [1, 64])
async def test_a_call_that_hangs_in_a_batch_times_out_alone_and_the_rest_of_the_batch_is_scored(tmp_path,
                                                                                                 batch_size):
    scorer = Scorer(VerifierConfig(reward_timeout_s=2.0, reward_workers=1, reward_batch_size=batch_size))
    try:
        env = batched(tmp_path)
        await scorer.score(env, "44")  # the pool is started: the next calls queue together
        completions = ["44", "5", "hang", "44", "hang", "5", "44"]
        t0 = time.monotonic()
        results = await asyncio.gather(*(scorer.score(env, c) for c in completions))
        for c, r in zip(completions, results):
            if c == "hang":
                assert r.infra_error and "exceeded 2.0 s" in r.details["reason"], r
            else:
                assert not r.infra_error and r.total == float(c == "44"), (c, r)
        assert time.monotonic() - t0 < 60  # two timeouts and two restarts, not a timeout per call of the batch
        again = await scorer.score(env, "44")  # the killed worker was replaced
        assert again.total == 1.0 and not again.infra_error
    finally:
        await scorer.close()


async def test_each_call_of_a_batch_is_timed_from_its_own_start(tmp_path):
    scorer = Scorer(VerifierConfig(reward_timeout_s=2.0, reward_workers=1))
    try:
        env = batched(tmp_path)
        await scorer.score(env, "44")  # the pool is started: the next calls queue together, one batch
        results = await asyncio.gather(*(scorer.score(env, "slow") for _ in range(3)))  # 3.6 s, each < 2 s
        assert [(r.total, r.infra_error) for r in results] == [(0.0, False)] * 3, results
    finally:
        await scorer.close()


async def test_a_call_that_kills_its_worker_fails_alone_and_the_rest_of_the_batch_is_scored(tmp_path):
    scorer = Scorer(VerifierConfig(reward_workers=1))
    try:
        env = batched(tmp_path)
        await scorer.score(env, "44")  # the pool is started: the next calls queue together, one batch
        completions = ["44", "crash", "5", "44"]
        results = await asyncio.gather(*(scorer.score(env, c) for c in completions))
        crashed = results.pop(1)
        assert crashed.infra_error and "died" in crashed.details["reason"], crashed
        assert [(r.total, r.infra_error) for r in results] == [(1.0, False), (0.0, False), (1.0, False)]
    finally:
        await scorer.close()


async def test_a_hung_worker_does_not_hold_up_the_other_workers_of_its_environment(tmp_path):
    scorer = Scorer(VerifierConfig(reward_timeout_s=300.0, reward_workers=2))
    try:
        env = batched(tmp_path)
        await scorer.score(env, "44")  # the pool is started
        stuck = asyncio.create_task(scorer.score(env, "hang"))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        results = await asyncio.gather(*(scorer.score(env, c) for c in ["44", "5"] * 20))
        assert [r.total for r in results] == [1.0, 0.0] * 20 and time.monotonic() - t0 < 10
        assert not stuck.done()
        stuck.cancel()
    finally:
        await scorer.close()


async def test_closing_answers_the_calls_in_flight_and_queued_with_an_infrastructure_error(tmp_path):
    scorer = Scorer(VerifierConfig(reward_timeout_s=300.0, reward_workers=1))
    env = batched(tmp_path)
    await scorer.score(env, "44")  # the pool is started
    calls = [asyncio.create_task(scorer.score(env, c)) for c in ["hang", "44", "5"]]
    await asyncio.sleep(0.5)
    await scorer.close()
    results = await asyncio.wait_for(asyncio.gather(*calls), timeout=10)
    assert all(r.infra_error and "closed" in r.details["reason"] for r in results), results
