"""Environments served over HTTP: an OpenEnv server (``POST /reset``, ``POST /step``, or its WebSocket ``/ws``) as
a multi-turn :class:`~shared.envs.api.Environment`.

OpenEnv (github.com/meta-pytorch/OpenEnv) has two transports, chosen by ``transport``:

- ``"http"`` (the default): ``POST /reset`` (a JSON body, ``{}`` or with ``seed``, ``episode_id`` and the
  environment's own fields) starts an episode, ``POST /step`` with ``{"action": {...}}`` acts in it, and both
  answer ``{"observation": {...}, "reward": float | null, "done": bool}``. The plain HTTP endpoints carry no
  session: the episode lives in the server, so one server plays one episode at a time. This is for servers that
  keep one environment per process: OpenEnv's 0.1.x (openenv-core), or your own. Current OpenEnv servers
  answer each HTTP request with a **fresh** environment, so a step there never sees the reset: use ``"ws"``.
- ``"ws"``: OpenEnv's WebSocket ``/ws`` (openenv-core 0.2.0 and later), one session, so one environment, per
  connection: each rollout opens its own, and one server plays as many episodes at once as its
  ``max_concurrent_envs`` allows (:mod:`shared.envs.openenv_ws`).

:func:`openenv_environment` takes a **pool** of server URLs. Over HTTP each rollout leases a free server in
``setup`` for its whole life, and gives it back in ``cleanup`` (which the rollout runs whatever happened): run at
least as many servers as rollouts that play at once (``samples_per_task`` times the groups the rollout service
runs together). Over WebSocket a rollout takes a place on the least busy server (``sessions_per_server`` places
each, no limit by default), opens its session in ``setup`` and closes it in ``cleanup``. A rollout that finds no
room within ``acquire_timeout_s`` is an error sample, never a wait without end. The pool lives in the process that
loaded the environment: give every rollout-service process its own servers (or places).

Per rollout:

- ``setup`` takes a server and resets with the row's ``info["reset"]`` (a dict, ``{}`` without one).
  The first observation is **not shown** to the model: the rollout's prompt is the dataset row's, made before the
  episode starts, so the row must say what the task is (and ``info["reset"]`` pick the episode, by ``seed`` for
  instance). It is kept in ``state["openenv"]["reset_observation"]`` only when small (see
  :data:`STATE_OBSERVATION_CHARS`).
- ``env_response`` sends the model's last message as the action, ``{action_field: text}``, and returns the
  observation rendered as text (its ``observation_field``, or the whole observation as compact JSON; cut in the
  middle past ``max_observation_chars``) as the next user turn; ``done`` ends the rollout.
- the server's rewards accumulate in ``state["openenv"]["rewards"]`` (``null`` ones kept as ``None``); the
  rubric's one function, ``openenv_reward``, reads them: their sum, or the last non-null one, mapped from
  ``reward_range`` onto [0, 1].

A server that cannot be reached, answers late, with a status other than 2xx (over WebSocket: an ``error``
message, or the connection closed mid-episode), or with something other than the protocol's JSON raises
:class:`OpenEnvError` in the hook, which the rollout turns into an error sample (an infrastructure failure,
retried and counted, never a 0 reward); a state without an episode, or a reward outside ``reward_range``, is a
:class:`~shared.envs.api.RewardError` in the verifier, the same. The verifier and the driver load the environment
too, but never call a server: rewards read only the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import orjson

from shared.envs.api import Environment, RewardError, Rubric
from shared.envs.openenv_pool import OpenEnvError, ServerPool, parse_result

OBSERVATION_CHARS = 4000
"""Default longest observation shown to the model (characters); longer ones are cut in the middle."""

STATE_OBSERVATION_CHARS = 2000
"""Largest reset observation (compact JSON, characters) kept in the state; the state travels with the
trajectory and must stay small."""

async def _post(url: str, path: str, body: dict[str, Any], timeout_s: float,
                headers: dict[str, str] | None) -> dict[str, Any]:
    """``POST url+path`` with ``body`` as JSON; the answer's JSON object.

    Raises:
        OpenEnvError: no connection, no answer within ``timeout_s`` (each of connect, write and read), a status
            other than 2xx, or a body that is not a JSON object.
    """
    import httpx  # here, not at the top: importing shared.envs stays cheap for the processes that never call

    where = f"POST {url}{path}"
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
            response = await client.post(url + path, json=body)
    except httpx.TimeoutException as e:
        raise OpenEnvError(f"{where} got no answer within {timeout_s:g} s ({type(e).__name__})") from e
    except httpx.HTTPError as e:
        raise OpenEnvError(f"{where} failed: {type(e).__name__}: {str(e)[:300]}") from e
    if not 200 <= response.status_code < 300:
        raise OpenEnvError(f"{where} answered HTTP {response.status_code}: {response.text[:300]!r}")
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError as e:
        raise OpenEnvError(f"{where} answered something that is not JSON: {response.text[:200]!r}") from e
    if not isinstance(data, dict):
        raise OpenEnvError(f"{where} answered {type(data).__name__}, not a JSON object")
    return data


def render_observation(observation: dict[str, Any], field: str | None, max_chars: int = OBSERVATION_CHARS) -> str:
    """The text the model reads: ``observation[field]`` (text as it is, anything else as compact JSON), or the
    whole observation as compact JSON when ``field`` is None; cut in the middle past ``max_chars``.

    Raises:
        OpenEnvError: the observation has no ``field``.
    """
    if field is not None and field not in observation:
        raise OpenEnvError(f"the observation has no field {field!r}; it has {sorted(observation)[:20]}")
    value = observation if field is None else observation[field]
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    return text if len(text) <= max_chars else text[: max_chars // 2] + "\n...[cut]...\n" + text[-max_chars // 2:]


@dataclass(eq=False)
class HttpTransport:
    """The HTTP transport: a server of the pool leased per rollout, ``POST /reset`` and ``POST /step`` on it."""

    pool: ServerPool
    timeout_s: float
    acquire_timeout_s: float
    headers: dict[str, str] | None
    name = "http"

    async def begin(self) -> dict[str, Any]:
        """Lease a server: the episode's ``url`` and ``lease``.

        Raises:
            OpenEnvError: no free server in time.
        """
        url, token = await self.pool.acquire(self.acquire_timeout_s)
        return {"url": url, "lease": token}

    async def reset(self, episode: dict, body: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        url = episode["url"]
        return parse_result(await _post(url, "/reset", body, self.timeout_s, self.headers), f"POST {url}/reset")

    async def step(self, episode: dict, action: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        url = episode["url"]
        return parse_result(await _post(url, "/step", {"action": action}, self.timeout_s, self.headers),
                            f"POST {url}/step")

    async def end(self, episode: dict) -> None:
        """Give the server back (nothing when the episode holds no lease)."""
        if "lease" in episode:
            self.pool.release(episode["url"], episode.pop("lease"))


@dataclass(eq=False)
class OpenEnvHooks:
    """The hooks and the reward of :func:`openenv_environment` (see the module docstring); one per environment,
    shared by its rollouts, which keep their own part in ``state["openenv"]``. ``transport`` is
    :class:`HttpTransport` or :class:`shared.envs.openenv_ws.WebSocketTransport`."""

    transport: Any
    action: Callable[[str], dict[str, Any]]
    observation_field: str | None
    reward: str
    reward_range: tuple[float, float]
    max_observation_chars: int

    @property
    def pool(self) -> ServerPool:
        """The transport's servers."""
        return self.transport.pool

    async def setup(self, state: dict, info: dict) -> None:
        """Lease a server (over WebSocket: and open a session on it) and start an episode (reset with
        ``info["reset"]``).

        Raises:
            OpenEnvError: no free server in time, ``info["reset"]`` is not a dict, or the connection or the reset
                failed.
        """
        body = (info or {}).get("reset")
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise OpenEnvError(f"the row's info['reset'] is {type(body).__name__}, not a dict (the reset's body)")
        episode = state["openenv"] = {**await self.transport.begin(), "rewards": [], "done": False, "steps": 0}
        observation, reward, done = await self.transport.reset(episode, body)
        if reward is not None:
            episode["rewards"].append(reward)
        episode["done"] = done
        kept = orjson.dumps(observation, default=str)
        if len(kept) <= STATE_OBSERVATION_CHARS:
            episode["reset_observation"] = orjson.loads(kept)

    async def env_response(self, completion: str, state: dict) -> str | None:
        """Send ``completion`` as the action (a step); the observation as text, or None when done.

        Raises:
            OpenEnvError: the rollout has no episode (setup did not run), the step failed, or the observation
                lacks ``observation_field``.
        """
        episode = state.get("openenv")
        if not isinstance(episode, dict) or "url" not in episode:
            raise OpenEnvError("no OpenEnv episode in this rollout's state: its setup did not run")
        if episode["done"]:
            return None
        observation, reward, done = await self.transport.step(episode, self.action(completion))
        episode["steps"] += 1
        episode["rewards"].append(reward)
        episode["done"] = done
        return None if done else render_observation(observation, self.observation_field, self.max_observation_chars)

    async def cleanup(self, state: dict) -> None:
        """End the rollout's hold on its server (HTTP: give it back; WebSocket: close the session, then give it
        back); nothing when setup took none. Never raises: the episode is over."""
        episode = state.get("openenv")
        if isinstance(episode, dict):
            await self.transport.end(episode)

    def openenv_reward(self, state: dict) -> dict[str, float]:
        """The episode's reward in [0, 1]: the sum of the server's rewards (``reward="sum"``) or the last non-null
        one (``"last"``; 0 when none), mapped linearly from ``reward_range``; metrics ``raw`` (before mapping),
        ``steps`` and ``done`` (1.0 when the server ended the episode).

        Raises:
            RewardError: the state holds no episode, or the raw reward is outside ``reward_range``.
        """
        episode = state.get("openenv")
        if not isinstance(episode, dict) or not isinstance(episode.get("rewards"), list):
            raise RewardError("the rollout's state holds no OpenEnv episode (state['openenv']['rewards'])")
        values = [float(r) for r in episode["rewards"] if r is not None]
        raw = sum(values) if self.reward == "sum" else (values[-1] if values else 0.0)
        lo, hi = self.reward_range
        score = (raw - lo) / (hi - lo)
        if not -1e-9 <= score <= 1 + 1e-9:
            raise RewardError(f"the server's reward {raw:g} ({self.reward} of {values}) is outside reward_range "
                              f"[{lo:g}, {hi:g}]: give the range its rewards can take")
        return {"score": min(1.0, max(0.0, score)), "raw": raw, "steps": float(episode.get("steps", 0)),
                "done": float(bool(episode.get("done")))}


TRANSPORTS = ("http", "ws")
"""The transports :func:`openenv_environment` speaks: ``http`` (``POST /reset``, ``/step``; one episode per server)
and ``ws`` (OpenEnv's ``/ws``, one session per rollout; :mod:`shared.envs.openenv_ws`)."""


def openenv_environment(url: str | Sequence[str], *, dataset: Any, transport: str = "http",
                        action_field: str = "message", action: Callable[[str], dict[str, Any]] | None = None,
                        observation_field: str | None = None, reward: str = "sum",
                        reward_range: tuple[float, float] = (0.0, 1.0), max_turns: int = 8, timeout_s: float = 30.0,
                        acquire_timeout_s: float = 10.0, sessions_per_server: int | None = None,
                        system_prompt: str | None = None, headers: dict[str, str] | None = None,
                        max_observation_chars: int = OBSERVATION_CHARS, **environment: Any) -> Environment:
    """A multi-turn environment played on OpenEnv servers (see the module docstring), for a loading function.

    Args:
        url: the server's base URL, or a list of them (the pool).
        dataset: the rows (as :class:`~shared.envs.api.Environment`): each row's prompt is what the model first
            reads; its ``info["reset"]``, a dict, is the reset's body (``{}`` without one).
        transport: ``"http"``: ``POST /reset`` and ``/step``, one rollout per server at a time (servers that keep
            one environment per process: OpenEnv 0.1.x, or your own); ``"ws"``: OpenEnv's
            WebSocket ``/ws``, one session (connection) per rollout, many per server (openenv-core 0.2.0 and
            later, whose HTTP endpoints keep no episode). URLs are ``http(s)://`` (``ws(s)://`` too for ``"ws"``).
        action_field: the action's one field the model's text goes in: ``{action_field: text}``.
        action: instead, a function of the model's text returning the action dict.
        observation_field: the observation's field shown to the model (``None``: the whole observation as JSON).
        reward: ``"sum"`` of the server's rewards over the episode, or the ``"last"`` non-null one.
        reward_range: ``(lo, hi)`` the raw reward can take, mapped onto [0, 1] (a pass is 1.0).
        max_turns: assistant turns per rollout (the episode may end before, on ``done``).
        timeout_s: bound on each HTTP request (connect, write and read, each), or on the WebSocket's opening and
            each message's answer (seconds).
        acquire_timeout_s: how long a rollout waits for a server with room before it is an error sample (seconds).
        sessions_per_server: ``"ws"`` only: the most sessions a rollout-service process opens on one server at a
            time (the server's ``max_concurrent_envs``; ``None``: no limit); more rollouts wait for room.
        system_prompt: the system message before every prompt given as text.
        headers: HTTP headers sent with every request or WebSocket handshake (an ``Authorization`` for instance).
        max_observation_chars: longest observation text shown; longer ones are cut in the middle.
        **environment: other :class:`~shared.envs.api.Environment` arguments (``name``, ``eval_dataset``,
            ``columns``, ``tools``).

    Raises:
        ValueError: a bad URL (see :class:`ServerPool`), a transport not in :data:`TRANSPORTS`,
            ``sessions_per_server`` with ``"http"`` or below 1, ``reward`` not ``sum`` or ``last``,
            ``reward_range`` not ``lo < hi``, a timeout not > 0; and what :class:`~shared.envs.api.Environment`
            raises.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if sessions_per_server is not None and (transport != "ws" or sessions_per_server < 1):
        raise ValueError(f"sessions_per_server is for transport 'ws' and >= 1, not {sessions_per_server!r} "
                         f"with {transport!r}")
    if reward not in ("sum", "last"):
        raise ValueError(f"reward must be 'sum' or 'last', not {reward!r}")
    lo, hi = (float(x) for x in reward_range)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"reward_range must be finite with lo < hi, not {reward_range!r}")
    if not (timeout_s > 0 and acquire_timeout_s >= 0 and max_observation_chars > 0):
        raise ValueError(f"timeout_s > 0, acquire_timeout_s >= 0 and max_observation_chars > 0 needed "
                         f"({timeout_s}, {acquire_timeout_s}, {max_observation_chars})")
    headers = dict(headers or {}) or None
    if transport == "ws":
        from shared.envs.openenv_ws import WS_SCHEMES, WebSocketTransport  # it imports this module

        pool = ServerPool(url, capacity=sessions_per_server, schemes=WS_SCHEMES)
        moves: Any = WebSocketTransport(pool, float(timeout_s), float(acquire_timeout_s), headers)
    else:
        moves = HttpTransport(ServerPool(url), float(timeout_s), float(acquire_timeout_s), headers)
    hooks = OpenEnvHooks(moves, action or (lambda text: {action_field: text}), observation_field, reward, (lo, hi),
                         int(max_observation_chars))
    # the hook bound covers the longest hook, setup: the wait for a server, then the reset's request (HTTP) or the
    # connection and the reset's message (WebSocket), with room for the per-phase timeouts to fire first and say
    # which; a WebSocket cleanup (the close message, then the server's close) fits it too
    bound = acquire_timeout_s + 2 * timeout_s + 1.0
    return Environment(dataset=dataset, rubric=Rubric([hooks.openenv_reward]), system_prompt=system_prompt,
                       setup=hooks.setup, env_response=hooks.env_response, cleanup=hooks.cleanup,
                       max_turns=max_turns, hook_timeout_s=bound, **environment)
