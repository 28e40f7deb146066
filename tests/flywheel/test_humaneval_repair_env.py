"""The human-eval repair loop through the public environment API (environments/humaneval_repair): its verdicts
equal the built-in ``unit_tests`` kind's on the same answers, a failing answer gets the failures as its next
observation and a fixed one ends the rollout, all in the rollout's sandbox session (the real sandbox service)."""

from __future__ import annotations

import random

import pytest

from flywheel.domains import humaneval
from shared.auth import token_from_run_dir
from shared.client import AsyncApiClient, RetryPolicy
from shared.envs import load_environment
from shared.envs.loading import EnvironmentRef
from shared.envs.sandbox import Sandbox
from shared.schemas import Task
from verifier_service.config import VerifierConfig
from verifier_service.scorers import Scorer

PROBLEMS = 6


@pytest.fixture(scope="module")
def env():
    return load_environment(EnvironmentRef(id="humaneval-repair"))


def _client(url: str) -> AsyncApiClient:
    return AsyncApiClient(url, lambda: token_from_run_dir(None), timeout=60.0,
                          retry=RetryPolicy(deadline_s=60.0, retry_for_s=2.0))


def test_the_package_holds_every_problem_split_as_the_built_in_domain(env):
    assert len(env.dataset) == 164 - 32 and len(env.eval_dataset) == 32
    assert [t["function"]["name"] for t in env.tool_schemas()] == ["run_python"]
    assert env.multi_turn and env.max_turns == 3
    assert env.eval_dataset[0]["info"]["problem"] == humaneval.make(1, split="eval")[0]["metadata"]["problem"]


async def test_verdicts_equal_the_built_in_unit_tests_kind(env, sandbox_url):
    rows = env.eval_dataset[:PROBLEMS // 2] + env.dataset[:PROBLEMS // 2]
    builtin = {t["metadata"]["problem"]: t for t in humaneval.make(200, split="train") + humaneval.make(40, split="eval")}
    http = _client(sandbox_url)
    scorer = Scorer(VerifierConfig(sandbox_url=sandbox_url))
    rng = random.Random(0)
    env_verdicts, builtin_verdicts = [], []
    try:
        for row in rows:
            task = builtin[row["info"]["problem"]]
            for answer in (humaneval.gold(task), humaneval.corrupt(task, rng)):
                box = Sandbox(http)
                state: dict = {}
                try:
                    await env.cleanup(completion=answer, state=state, info=row["info"], sandbox=box)
                finally:
                    await box.close()
                env_verdicts.append(env.rubric.score(state=state).score)
                r = await scorer.score(Task.model_validate(task).verifier, answer)
                assert not r.infra_error, r.details
                builtin_verdicts.append(r.total)
    finally:
        await scorer.close()
        await http.aclose()
    assert env_verdicts == builtin_verdicts == [1.0, 0.0] * len(rows)


async def test_a_failing_answer_gets_its_failures_and_a_fixed_one_ends_the_rollout(env, sandbox_url):
    row = env.dataset[0]
    task = next(t for t in humaneval.make(200) if t["metadata"]["problem"] == row["info"]["problem"])
    http = _client(sandbox_url)
    box, state = Sandbox(http), {}
    try:
        feedback = await env.env_response(completion=humaneval.corrupt(task, random.Random(0)), state=state,
                                          info=row["info"], sandbox=box)
        assert feedback.startswith("Some tests failed:") and "NotImplementedError" in feedback
        assert await env.env_response(completion=humaneval.gold(task), state=state, info=row["info"],
                                      sandbox=box) is None
        assert state == {"attempts": 2, "passed": True}
        assert env.rubric.score(state=state).score == 1.0
        assert env.rubric.score(state=state).metrics == {"attempts.count": 2.0}
    finally:
        await box.close()
        await http.aclose()
