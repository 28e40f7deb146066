"""OpenEnv's WebSocket transport (``openenv_environment(..., transport="ws")``) against a real server: the word
game of ``tests/support/openenv_server.py`` under uvicorn in a subprocess, whose ``/ws`` plays one episode per
connection, many at once, as openenv-core 0.2.0+ does. Concurrent sessions on one server keep their own episodes;
a server that is down, refuses the handshake, answers an error message, something that is not JSON, late, or
closes the connection mid-episode makes an error sample; the server's capacity and ``sessions_per_server``; whole
rollouts with a tiny taught model."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from flywheel.broker import free_port
from shared.envs.http_env import OpenEnvError, openenv_environment
from shared.envs.openenv_ws import parse_message, ws_url
from shared.envs.tools import HookError
from tests.rollout_service.test_env_loop import engine  # noqa: F401 - the taught model, a fixture
from tests.shared.test_http_env import _cleanup, _rollouts, _say, _setup
from tests.support import openenv_server

MAX_SESSIONS = 3


@pytest.fixture(scope="module")
def server():
    """One word-game server with room for :data:`MAX_SESSIONS` sessions; stopped by pid at the end."""
    port = free_port()
    proc = openenv_server.start(port, max_sessions=MAX_SESSIONS)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        openenv_server.stop(proc)


@pytest.fixture
def down_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def _ws(url, **kw):
    return openenv_environment(url, dataset=[], transport="ws", observation_field="message", **kw)


def _transport(env):
    return env.setup.__self__.transport


def _sessions(url: str, want: int, wait_s: float = 5.0) -> int:
    """The server's open sessions once they are ``want`` (it drops a session as it closes), or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while (active := httpx.get(f"{url}/sessions").json()["active"]) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return active


async def test_concurrent_rollouts_on_one_server_play_their_own_episodes(server):
    env = _ws(server, reward_range=(0, 2))
    one, two = {}, {}
    await asyncio.gather(_setup(env, one, {"word": "cat", "hint_reward": 0.25}), _setup(env, two, {"word": "owl"}))
    assert one["openenv"]["url"] == two["openenv"]["url"] == server and _sessions(server, 2) == 2
    assert one["openenv"]["reset_observation"] == {"message": "Guess my 3-letter word.", "attempts_left": 5,
                                                   "length": 3}
    assert await asyncio.gather(_say(env, one, "owl"), _say(env, two, "owl")) == [
        "No. 0 of 3 letters in place.", None]  # "owl" solves two's episode only
    assert await _say(env, one, "cot") == "No. 2 of 3 letters in place."
    assert await _say(env, one, "Cat!") is None
    assert one["openenv"]["rewards"] == [0.25, 0.25, 1.0] and one["openenv"]["steps"] == 3
    assert two["openenv"]["rewards"] == [1.0] and two["openenv"]["steps"] == 1 and two["openenv"]["done"]
    assert httpx.get(f"{server}/state").json()["step_count"] == 0  # the HTTP episode saw none of it
    await asyncio.gather(_cleanup(env, one), _cleanup(env, two))
    assert "lease" not in one["openenv"] and _transport(env).open_sessions == 0 and env.setup.__self__.pool.in_use == 0
    assert _sessions(server, 0) == 0  # each session ended on the server
    score = env.rubric.score(state=orjson.loads(orjson.dumps(one)))  # the state is JSON: no connection in it
    assert score.score == pytest.approx(0.75) and score.metrics["openenv_reward.steps"] == 3.0


@pytest.mark.parametrize("action, says", [
    ("boom", r"step: the server answered an error: the game crashed \(code EXECUTION_ERROR\)$"),
    ("garbage", r"step answered something that is not JSON: '<html>not json</html>'"),
    ("hangup", r"step: the server closed the connection \(code 1000\)"),
    ("slow", r"step got no answer within 0.5 s"),
])
async def test_a_step_that_fails_closes_or_answers_late_is_a_hook_error(server, action, says):
    env = _ws(server, timeout_s=0.5)
    state: dict = {}
    await _setup(env, state, {"word": "cat"})
    with pytest.raises(HookError, match=rf"^environment hook env_response raised OpenEnvError: WS "
                                        rf"{ws_url(server)} {says}"):
        await _say(env, state, action)
    await _cleanup(env, state)
    assert _transport(env).open_sessions == 0 and env.setup.__self__.pool.in_use == 0
    assert _sessions(server, 0) == 0


async def test_an_action_the_server_cannot_read_is_a_hook_error(server):
    env = openenv_environment(server, dataset=[], transport="ws", action=lambda text: {"guess": text})
    state: dict = {}
    await _setup(env, state, {"word": "cat"})
    with pytest.raises(HookError, match=r"step: the server answered an error: Invalid message \(code "
                                        r"VALIDATION_ERROR\)"):
        await _say(env, state, "cat")
    await _cleanup(env, state)


@pytest.mark.parametrize("reset, says", [
    ({"fail": "500"}, r"reset: the server answered an error: the game crashed \(code EXECUTION_ERROR\)"),
    ({"fail": "hangup"}, r"reset: the server closed the connection"),
    ({"seed": -1}, r"reset: the server answered an error: bad reset arguments: Input should be greater than or "
                   r"equal to 0 \(code EXECUTION_ERROR\)"),
])
async def test_a_reset_that_fails_is_a_hook_error_and_the_session_is_closed(server, reset, says):
    env = _ws(server)
    state: dict = {}
    with pytest.raises(HookError, match=rf"^environment hook setup raised OpenEnvError: WS {ws_url(server)} "
                                        + says):
        await _setup(env, state, reset)
    await _cleanup(env, state)
    assert _transport(env).open_sessions == 0 and _sessions(server, 0) == 0


async def test_a_server_that_is_down_or_has_no_ws_endpoint_is_a_hook_error(server, down_url):
    down = _ws(down_url, timeout_s=2)
    state: dict = {}
    with pytest.raises(HookError, match=rf"^environment hook setup raised OpenEnvError: WS {ws_url(down_url)} "
                                        "failed to connect: ConnectionRefusedError"):
        await _setup(down, state)
    assert "openenv" not in state and down.setup.__self__.pool.in_use == 0
    old = _ws(f"{server}/old")  # as a server without /ws (openenv-core 0.1.x): the handshake is refused
    with pytest.raises(HookError, match=r"WS ws://127.0.0.1:\d+/old/ws refused the connection: HTTP 403 \(a server "
                                        r"without /ws: OpenEnv 0.1.x plays over transport 'http'\)"):
        await _setup(old, {})


async def test_the_server_at_capacity_is_an_error_and_sessions_per_server_waits_for_room(server):
    env = _ws(server)
    held = [{} for _ in range(MAX_SESSIONS)]
    for state in held:
        await _setup(env, state, {"word": "cat"})
    extra: dict = {}
    with pytest.raises(HookError, match=r"reset: the server answered an error: Server at capacity: 3/3 sessions "
                                        r"active. Cannot accept new connections. \(code CAPACITY_REACHED\); the server "
                                        r"holds its max_concurrent_envs sessions"):
        await _setup(env, extra)
    await _cleanup(env, extra)
    for state in held:
        await _cleanup(env, state)
    assert _sessions(server, 0) == 0

    polite = _ws(server, sessions_per_server=2, acquire_timeout_s=0.3)
    one, two, three = {}, {}, {}
    await asyncio.gather(_setup(polite, one), _setup(polite, two))
    with pytest.raises(HookError, match=r"all 1 OpenEnv servers have their 2 sessions in use \(waited 0.3 s\)"):
        await _setup(polite, three)
    assert "openenv" not in three

    async def later_cleanup():
        await asyncio.sleep(0.1)
        await _cleanup(polite, one)

    await asyncio.gather(_setup(polite, three, {"word": "bee"}), later_cleanup())  # waits for one's place
    assert await _say(polite, three, "bee") is None and three["openenv"]["rewards"] == [1.0]
    for state in (two, three):
        await _cleanup(polite, state)
    assert polite.setup.__self__.pool.in_use == 0 and _sessions(server, 0) == 0


@pytest.mark.parametrize("message, says", [
    (b'{"type": "error", "data": {"message": "no", "code": "SESSION_ERROR"}}',
     "where: the server answered an error: no \\(code SESSION_ERROR\\)$"),
    (b'{"type": "state", "data": {}}', "where answered a message of type 'state', not 'observation'"),
    (b'{"type": "observation", "data": []}', "where: the observation message's 'data' is list"),
    (b'{"type": "observation", "data": {"observation": {}, "done": 1}}', "where: 'done' is '1', not a boolean"),
    (b'[1]', "where answered list, not a JSON object"),
])
def test_a_message_outside_the_protocol_is_refused(message, says):
    with pytest.raises(OpenEnvError, match=f"^{says}"):
        parse_message(message, "where")
    ok = b'{"type": "observation", "data": {"observation": {"a": 1}, "reward": null, "done": false}}'
    assert parse_message(ok, "where") == ({"a": 1}, None, False)


def test_urls_and_arguments():
    assert ws_url("http://h:1/") == "ws://h:1/ws" and ws_url("https://h") == "wss://h/ws"
    assert ws_url("ws://h:1") == "ws://h:1/ws"
    openenv_environment("wss://h", dataset=[], transport="ws")
    with pytest.raises(ValueError, match="distinct http/https URLs"):
        openenv_environment("ws://h", dataset=[])
    with pytest.raises(ValueError, match="transport must be one of"):
        openenv_environment("http://h", dataset=[], transport="grpc")
    with pytest.raises(ValueError, match="sessions_per_server is for transport 'ws'"):
        openenv_environment("http://h", dataset=[], sessions_per_server=4)


async def test_rollouts_share_one_server_and_a_failing_one_makes_error_samples(engine, server,  # noqa: F811
                                                                              down_url):
    env = _ws(server, max_turns=2)
    runs = await _rollouts(engine, env, {"word": "dog", "hint_reward": 0.25}, n=3)
    for ro in runs:  # three rollouts, one server: a session each
        assert ro.error is None and [t["role"] for t in ro.rollout.turns] == ["assistant", "user", "assistant"]
        assert ro.rollout.turns[1]["text"] == "No. 0 of 3 letters in place."
        assert ro.state["openenv"]["rewards"] == [0.25] and ro.state["openenv"]["url"] == server
        assert env.rubric.score(state=ro.state_record()).score == 0.25
    assert _transport(env).open_sessions == 0 and _sessions(server, 0) == 0
    (solved,) = await _rollouts(engine, env, {"word": "50"}, n=1)
    assert solved.error is None and env.rubric.score(state=solved.state_record()).score == 1.0
    (hung,) = await _rollouts(engine, env, {"fail": "hangup"}, n=1)
    assert hung.error.startswith(f"environment hook setup raised OpenEnvError: WS {ws_url(server)} reset: the "
                                 "server closed the connection") and hung.rollout.ids == []
    down = _ws(down_url, timeout_s=2)
    (ro,) = await _rollouts(engine, down, {}, n=1)
    assert ro.error.startswith(f"environment hook setup raised OpenEnvError: WS {ws_url(down_url)} failed to "
                               "connect") and ro.rollout.ids == []
    assert _sessions(server, 0) == 0
