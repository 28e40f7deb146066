"""Environments served over HTTP (the OpenEnv reset/step protocol), against real servers: the word game of
``tests/support/openenv_server.py`` under uvicorn in subprocesses. An episode's hooks, its rewards reaching the
rubric, the failures that make an error sample (a server that is down, answers 500, garbage or late), the pool
that gives concurrent rollouts their own servers, and whole rollouts with a tiny taught model."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import orjson
import pytest

from flywheel.broker import free_port
from rollout_service.env_loop import encode_with_tools, run_env_loop
from shared.envs import EnvironmentRef, RewardError, load_environment
from shared.envs.http_env import OpenEnvError, ServerPool, openenv_environment, parse_result
from shared.envs.tools import HookError, call_hook
from shared.schemas import Task
from tests.rollout_service.test_env_loop import GREEDY, engine  # noqa: F401 - the taught model, a fixture
from tests.support import openenv_server


@pytest.fixture(scope="module")
def servers():
    """Two word-game servers, each its own process on a free port; stopped by pid at the end."""
    procs = []
    try:
        for _ in range(2):
            port = free_port()
            procs.append((openenv_server.start(port), f"http://127.0.0.1:{port}"))
        yield [url for _, url in procs]
    finally:
        for proc, _ in procs:
            openenv_server.stop(proc)


@pytest.fixture
def down_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def _context(state: dict, reset: dict | None = None, **more) -> dict:
    """What the rollout passes a hook (``rollout_service.env_loop._context``), the row's info holding ``reset``."""
    return {"state": state, "task": {}, "prompt": [], "answer": None,
            "info": {} if reset is None else {"reset": reset}, **more}


async def _setup(env, state: dict, reset: dict | None = None) -> None:
    await call_hook(env.setup, _context(state, reset), env.hook_timeout_s)


async def _say(env, state: dict, text: str) -> str | None:
    return await call_hook(env.env_response, _context(state, completion=text, turn=1), env.hook_timeout_s)


async def _cleanup(env, state: dict) -> None:
    await call_hook(env.cleanup, _context(state), env.hook_timeout_s)


def _pool(env) -> ServerPool:
    return env.setup.__self__.pool


async def test_an_episode_resets_steps_until_done_and_its_rewards_reach_the_rubric(servers):
    env = openenv_environment(servers[0], dataset=[], observation_field="message", reward_range=(0, 2))
    state: dict = {}
    await _setup(env, state, {"word": "dog", "hint_reward": 0.25})
    episode = state["openenv"]
    assert episode["url"] == servers[0] and episode["rewards"] == [] and episode["done"] is False
    assert episode["reset_observation"] == {"message": "Guess my 3-letter word.", "attempts_left": 5, "length": 3}
    assert await _say(env, state, "dot") == "No. 2 of 3 letters in place."
    assert await _say(env, state, "cat") == "No. 0 of 3 letters in place."
    assert await _say(env, state, " Dog.") is None  # solved: done ends the rollout
    assert episode["rewards"] == [0.25, 0.25, 1.0] and episode["steps"] == 3 and episode["done"] is True
    assert await _say(env, state, "dog") is None  # after done nothing is sent
    assert httpx.get(f"{servers[0]}/state").json()["step_count"] == 3
    await _cleanup(env, state)
    assert _pool(env).in_use == 0 and "lease" not in episode
    score = env.rubric.score(state=orjson.loads(orjson.dumps(state)))  # as the state reaches the verifier
    assert score.score == pytest.approx(0.75) and score.rewards == {"openenv_reward": pytest.approx(0.75)}
    assert score.metrics == {"openenv_reward.raw": 1.5, "openenv_reward.steps": 3.0, "openenv_reward.done": 1.0}
    last = openenv_environment(servers[0], dataset=[], reward="last")
    assert last.rubric.score(state=state).score == 1.0


async def test_the_observation_is_shown_as_compact_json_without_a_field_and_cut_when_long(servers):
    env = openenv_environment(servers[0], dataset=[])
    state: dict = {}
    await _setup(env, state, {"word": "owl"})
    assert orjson.loads(await _say(env, state, "cat")) == {"message": "No. 0 of 3 letters in place.",
                                                           "attempts_left": 4, "length": 3}
    await _cleanup(env, state)
    short = openenv_environment(servers[0], dataset=[], max_observation_chars=20, observation_field="message")
    await _setup(short, state := {}, {"word": "owl"})
    assert await _say(short, state, "cat") == "No. 0 of 3\n...[cut]...\n in place."
    await _cleanup(short, state)
    missing = openenv_environment(servers[0], dataset=[], observation_field="board")
    await _setup(missing, state := {}, {"word": "owl"})
    with pytest.raises(HookError, match=r"OpenEnvError: the observation has no field 'board'; it has "
                                        r"\['attempts_left', 'length', 'message'\]"):
        await _say(missing, state, "cat")
    await _cleanup(missing, state)


@pytest.mark.parametrize("reset, says", [
    ({"fail": "500"}, r"answered HTTP 500: .*the game crashed"),
    ({"fail": "garbage"}, r"answered something that is not JSON: '<html>not json</html>'"),
])
async def test_a_reset_that_fails_is_a_hook_error_and_the_server_goes_back(servers, reset, says):
    env = openenv_environment(servers[0], dataset=[])
    state: dict = {}
    with pytest.raises(HookError, match=rf"^environment hook setup raised OpenEnvError: POST {servers[0]}/reset "
                                        + says):
        await _setup(env, state, reset)
    assert _pool(env).in_use == 1
    await _cleanup(env, state)  # the rollout's cleanup runs whatever happened: the lease ends
    assert _pool(env).in_use == 0


async def test_a_server_that_is_down_is_a_hook_error(down_url):
    env = openenv_environment([down_url], dataset=[], timeout_s=2)
    state: dict = {}
    with pytest.raises(HookError, match=rf"^environment hook setup raised OpenEnvError: POST {down_url}/reset "
                                        "failed: ConnectError"):
        await _setup(env, state)
    await _cleanup(env, state)
    assert _pool(env).in_use == 0


@pytest.mark.parametrize("action, says", [
    ("boom", r"answered HTTP 500"),
    ("garbage", r"answered something that is not JSON"),
    ("slow", r"got no answer within 0.5 s \(ReadTimeout\)"),
])
async def test_a_step_that_fails_or_answers_late_is_a_hook_error(servers, action, says):
    env = openenv_environment(servers[1], dataset=[], timeout_s=0.5)
    state: dict = {}
    await _setup(env, state, {"word": "cat"})
    with pytest.raises(HookError, match=rf"^environment hook env_response raised OpenEnvError: POST "
                                        rf"{servers[1]}/step {says}"):
        await _say(env, state, action)
    await _cleanup(env, state)


@pytest.mark.parametrize("answer, says", [
    ({"reward": 1.0, "done": True}, "'observation' is NoneType, not an object"),
    ({"observation": {}, "reward": "1", "done": False}, "'reward' is '1', not a finite number or null"),
    ({"observation": {}, "reward": float("nan"), "done": False}, "'reward' is 'nan'"),
    ({"observation": {}, "reward": None, "done": "yes"}, "'done' is 'yes', not a boolean"),
])
def test_an_answer_outside_the_protocol_is_refused(answer, says):
    with pytest.raises(OpenEnvError, match=f"^POST x/step: {says}"):
        parse_result(answer, "POST x/step")
    assert parse_result({"observation": {"a": 1}}, "x") == ({"a": 1}, None, False)


async def test_the_pool_gives_concurrent_rollouts_their_own_servers_and_waits_for_a_free_one(servers):
    env = openenv_environment(servers, dataset=[], observation_field="message", acquire_timeout_s=0.3)
    one, two = {}, {}
    await asyncio.gather(_setup(env, one, {"word": "cat"}), _setup(env, two, {"word": "owl"}))
    assert {one["openenv"]["url"], two["openenv"]["url"]} == set(servers)
    assert await asyncio.gather(_say(env, one, "owl"), _say(env, two, "owl")) == [
        "No. 0 of 3 letters in place.", None]  # each rollout plays its own episode
    assert await _say(env, one, "cat") is None and one["openenv"]["rewards"] == [0.0, 1.0]
    three: dict = {}
    with pytest.raises(HookError, match="all 2 OpenEnv servers are in use \\(waited 0.3 s\\)"):
        await _setup(env, three)
    assert "openenv" not in three

    async def later_cleanup():
        await asyncio.sleep(0.1)
        await _cleanup(env, two)

    await asyncio.gather(_setup(env, three, {"word": "bee"}), later_cleanup())  # waits, then gets two's server
    assert three["openenv"]["url"] == two["openenv"]["url"] and _pool(env).in_use == 2
    for state in (one, three):
        await _cleanup(env, state)
    assert _pool(env).in_use == 0


def test_rewards_read_the_state_and_refuse_what_they_cannot_score():
    env = openenv_environment("http://127.0.0.1:1", dataset=[], reward_range=(-1, 1))
    episode = {"rewards": [None, -1.0, None], "steps": 3, "done": False}
    assert env.rubric.score(state={"openenv": episode}).score == 0.0
    with pytest.raises(RewardError, match="holds no OpenEnv episode"):
        env.rubric.score(state={})
    with pytest.raises(RewardError, match=r"reward 3 \(sum of \[1.0, 2.0\]\) is outside reward_range \[-1, 1\]"):
        env.rubric.score(state={"openenv": {"rewards": [1.0, 2.0], "steps": 2, "done": True}})
    with pytest.raises(ValueError, match="reward must be 'sum' or 'last'"):
        openenv_environment("http://x", dataset=[], reward="mean")
    with pytest.raises(ValueError, match="distinct http"):
        openenv_environment(["http://x", "http://x/"], dataset=[])


def test_a_loading_function_builds_it_and_flywheel_env_exports_it(tmp_path):
    from flywheel.env import openenv_environment as public

    assert public is openenv_environment
    (tmp_path / "game.py").write_text(textwrap.dedent('''
        from flywheel.env import openenv_environment

        def load_environment(urls, n=4):
            rows = [{"question": "Guess my word.", "info": {"reset": {"seed": i}}} for i in range(n)]
            return openenv_environment(urls, dataset=rows, observation_field="message", max_turns=5)
    '''))
    env = load_environment(EnvironmentRef(path=str(tmp_path / "game.py"), args={"urls": ["http://127.0.0.1:9"]}))
    assert env.multi_turn and env.max_turns == 5 and env.rubric.names == ["openenv_reward"]


async def _rollouts(engine, env, reset: dict, n: int):  # noqa: F811 - the fixture's value
    msgs = [{"role": "user", "content": "case guess"}]  # the taught model answers "50"
    task = Task(task_id="t", domain="game", prompt=msgs, max_turns=env.max_turns,
                verifier={"kind": "environment", "environment": {"module": "unused"}, "info": {"reset": reset}})
    prompt = encode_with_tools(engine.tokenizer, msgs, [])
    return await run_env_loop(engine, engine.tokenizer, env, task, prompt, n, GREEDY, max_tokens=600)


async def test_rollouts_play_their_own_servers_and_a_down_one_makes_error_samples(engine, servers,  # noqa: F811
                                                                                   down_url):
    env = openenv_environment(servers, dataset=[], observation_field="message", max_turns=2)
    runs = await _rollouts(engine, env, {"word": "dog", "hint_reward": 0.25}, n=2)
    assert {ro.state["openenv"]["url"] for ro in runs} == set(servers) and _pool(env).in_use == 0
    for ro in runs:
        assert ro.error is None and [t["role"] for t in ro.rollout.turns] == ["assistant", "user", "assistant"]
        assert ro.rollout.turns[0]["text"] == "50" and ro.rollout.turns[1]["text"] == "No. 0 of 3 letters in place."
        assert ro.state["openenv"]["rewards"] == [0.25]
        assert env.rubric.score(state=ro.state_record()).score == 0.25
    (solved,) = await _rollouts(engine, env, {"word": "50"}, n=1)
    assert [t["role"] for t in solved.rollout.turns] == ["assistant"] and solved.state["openenv"]["done"]
    assert env.rubric.score(state=solved.state_record()).score == 1.0
    busy = openenv_environment(servers, dataset=[], acquire_timeout_s=0.2, max_turns=2)
    runs = await _rollouts(engine, busy, {"word": "50"}, n=3)  # three rollouts, two servers
    assert [ro.error for ro in runs[:2]] == [None, None] and runs[2].rollout.ids == []
    assert runs[2].error.startswith("environment hook setup raised OpenEnvError: all 2 OpenEnv servers are in use")
    down = openenv_environment([down_url], dataset=[], timeout_s=2)
    (ro,) = await _rollouts(engine, down, {}, n=1)
    assert ro.error.startswith(f"environment hook setup raised OpenEnvError: POST {down_url}/reset failed: "
                               "ConnectError") and ro.rollout.ids == [] and _pool(down).in_use == 0
