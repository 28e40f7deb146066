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
