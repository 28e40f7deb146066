"""A tiny OpenEnv-compatible server for the tests and the guide: a word-guessing game over ``POST /reset``,
``POST /step``, ``GET /state`` and ``GET /health`` with one episode per process (as an OpenEnv server without
sessions plays it), and over OpenEnv's WebSocket ``/ws`` with one episode per connection, many at once (as
openenv-core 0.2.0+'s ``HTTPEnvServer`` plays it).

``POST /reset`` takes ``{}`` or any of ``seed`` (picks the word from :data:`WORDS`), ``episode_id``, ``word`` (the
word itself), ``hint_reward`` (the reward of a wrong guess, default 0), ``max_attempts`` (default 5) and ``fail``
(``"500"``: answer HTTP 500; ``"garbage"``: answer 200 with a body that is not JSON). ``POST /step`` takes
``{"action": {"message": "<guess>"}}``: the guess that is the word (ignoring case and surrounding spaces and
punctuation) earns 1.0 and ends the episode; a wrong one earns ``hint_reward`` and a hint, and the last allowed
attempt ends it. The messages ``boom``, ``garbage`` and ``slow`` answer HTTP 500, a body that is not JSON, and
after 3 s. Answers are ``{"observation": {"message", "attempts_left", "length"}, "reward", "done"}``.

``/ws`` speaks OpenEnv's session protocol (``openenv/core/env_server/http_server.py``, ``types.py``): the client
sends ``{"type": "reset", "data": {<the reset fields>}}``, ``{"type": "step", "data": {"message": "<guess>"}}``
(the action itself), ``{"type": "state"}`` or ``{"type": "close"}``; the server answers
``{"type": "observation", "data": <the HTTP answer>}``, ``{"type": "state", "data": {...}}``, or
``{"type": "error", "data": {"message", "code"}}`` with OpenEnv's codes (``INVALID_JSON``, ``UNKNOWN_TYPE``,
``VALIDATION_ERROR``, ``EXECUTION_ERROR``; ``CAPACITY_REACHED`` then a close when the process already holds
``WORD_GAME_MAX_SESSIONS`` sessions, default 8). There ``fail``/the message ``500`` or ``boom`` is an
``EXECUTION_ERROR``, ``garbage`` a text that is not JSON, ``slow`` an answer after 3 s, and ``hangup`` closes the
connection without an answer. ``GET /sessions`` (not OpenEnv's; for the tests) says how many sessions are open.

Run it: ``python -m uvicorn tests.support.openenv_server:app --port 8011`` from the repository root, or
:func:`start` (a subprocess) and :func:`stop`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import Body, FastAPI, HTTPException, WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flywheel.broker import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("cat", "dog", "owl", "fox", "bee", "elk")
"""The words ``seed`` picks from (``WORDS[seed % 6]``)."""
MAX_SESSIONS = int(os.environ.get("WORD_GAME_MAX_SESSIONS", "8"))
"""The most ``/ws`` sessions at once (OpenEnv's ``max_concurrent_envs``)."""

app = FastAPI(title="word game (OpenEnv protocol)")


class ResetBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    seed: int | None = Field(None, ge=0)
    episode_id: str | None = None
    word: str | None = None
    hint_reward: float = 0.0
    max_attempts: int = Field(5, ge=1)
    fail: str | None = None


class StepBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    action: dict[str, Any]


class GuessAction(BaseModel):
    """The game's action model (a ``/ws`` step's ``data``), strict as OpenEnv's ``Action``."""
    model_config = ConfigDict(extra="forbid")
    message: str


class WSMessage(BaseModel):
    """OpenEnv's client messages (``WSResetMessage`` and the others): ``type`` and a ``data`` object only."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["reset", "step", "state", "close"]
    data: dict[str, Any] = Field(default_factory=dict)


class GameOver(Exception):
    """A step after the episode ended."""


class Game:
    """One episode of the word game."""

    def __init__(self) -> None:
        self.word, self.attempts_left, self.hint_reward = "", 0, 0.0
        self.episode_id: str | None = None
        self.steps, self.done = 0, True

    def answer(self, message: str, reward: float | None) -> dict[str, Any]:
        return {"observation": {"message": message, "attempts_left": self.attempts_left, "length": len(self.word)},
                "reward": reward, "done": self.done}

    def reset(self, body: ResetBody) -> dict[str, Any]:
        word = body.word or WORDS[(body.seed or 0) % len(WORDS)]
        self.word, self.attempts_left, self.hint_reward = word.lower(), body.max_attempts, body.hint_reward
        self.episode_id, self.steps, self.done = body.episode_id or uuid.uuid4().hex, 0, False
        return self.answer(f"Guess my {len(word)}-letter word.", None)

    def step(self, message: str) -> dict[str, Any]:
        if self.done:
            raise GameOver("the episode is over; reset")
        self.steps += 1
        guess = message.strip().strip(".!?\"' ").lower()
        if guess == self.word:
            self.done = True
            return self.answer("Correct!", 1.0)
        self.attempts_left -= 1
        self.done = self.attempts_left == 0
        in_place = sum(a == b for a, b in zip(guess, self.word))
        return self.answer(f"No. {in_place} of {len(self.word)} letters in place.", self.hint_reward)

    def state(self) -> dict[str, Any]:
        return {"episode_id": self.episode_id, "step_count": self.steps, "done": self.done}


GAME = Game()
"""The one episode the HTTP endpoints play."""
SESSIONS: dict[str, Game] = {}
"""The ``/ws`` sessions' episodes, by session id."""


def _misbehave(how: str | None) -> PlainTextResponse | None:
    if how in ("500", "boom"):
        raise HTTPException(500, "the game crashed")
    if how == "garbage":
        return PlainTextResponse("<html>not json</html>")
    return None


@app.post("/reset")
async def reset(body: ResetBody = Body(default_factory=ResetBody)):
    if (bad := _misbehave(body.fail)) is not None:
        return bad
    return GAME.reset(body)


@app.post("/step")
async def step(body: StepBody):
    message = body.action.get("message")
    if not isinstance(message, str):
        raise HTTPException(422, "action needs a 'message' string")
    if (bad := _misbehave(message.strip())) is not None:
        return bad
    if message.strip() == "slow":
        await asyncio.sleep(3)
    try:
        return GAME.step(message)
    except GameOver as e:
        raise HTTPException(409, str(e)) from None


@app.get("/state")
async def state():
    return GAME.state()


@app.get("/health")
async def health():
    return {"status": "healthy"}


@app.get("/sessions")
async def sessions():
    return {"active": len(SESSIONS), "max": MAX_SESSIONS}


def _error(message: str, code: str, **more: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **more}})


async def _play(game: Game, msg: WSMessage) -> str | None:
    """The answer to a reset or a step (``None``: hang up); raises what fails, as the environment would."""
    if msg.type == "reset":
        try:  # OpenEnv passes reset's data as keyword arguments: a bad one fails in the environment
            body = ResetBody(**msg.data)
        except ValidationError as e:
            raise ValueError(f"bad reset arguments: {e.errors()[0]['msg']}") from None
        how = body.fail
    else:
        action = GuessAction(**msg.data)
        how = action.message.strip()
    if how in ("500", "boom"):
        raise RuntimeError("the game crashed")
    if how == "garbage":
        return "<html>not json</html>"
    if how == "hangup":
        return None
    if how == "slow":
        await asyncio.sleep(3)
    data = game.reset(body) if msg.type == "reset" else game.step(action.message)
    return json.dumps({"type": "observation", "data": data})


@app.websocket("/ws")
async def ws(websocket: WebSocket):
    """One session per connection, as OpenEnv's ``websocket_endpoint``: accept, then refuse past capacity with an
    error and a close; errors are answered and the session goes on; ``close`` ends it."""
    await websocket.accept()
    session = None
    try:
        if len(SESSIONS) >= MAX_SESSIONS:
            await websocket.send_text(_error(
                f"Server at capacity: {len(SESSIONS)}/{MAX_SESSIONS} sessions active. Cannot accept new "
                "connections.", "CAPACITY_REACHED", active_sessions=len(SESSIONS), max_sessions=MAX_SESSIONS))
            return
        session = uuid.uuid4().hex
        game = SESSIONS[session] = Game()
        while True:
            raw = await websocket.receive_text()
            try:
                message = json.loads(raw)
            except json.JSONDecodeError as e:
                await websocket.send_text(_error(f"Invalid JSON: {e}", "INVALID_JSON"))
                continue
            kind = message.get("type", "") if isinstance(message, dict) else ""
            if kind not in ("reset", "step", "state", "close"):
                await websocket.send_text(_error(f"Unknown message type: {kind}", "UNKNOWN_TYPE"))
                continue
            try:
                msg = WSMessage(**message)
                if msg.type == "close":
                    break
                if msg.type == "state":
                    answer: str | None = json.dumps({"type": "state", "data": game.state()})
                else:
                    answer = await _play(game, msg)
                if answer is None:
                    return  # hang up mid-episode
                await websocket.send_text(answer)
            except WebSocketDisconnect:
                raise
            except ValidationError as e:
                await websocket.send_text(_error("Invalid message", "VALIDATION_ERROR",
                                                 errors=json.loads(e.json())))
            except Exception as e:  # noqa: BLE001 - as OpenEnv: any failure is an EXECUTION_ERROR answer
                await websocket.send_text(_error(str(e), "EXECUTION_ERROR"))
    except WebSocketDisconnect:
        pass
    finally:
        if session is not None:
            SESSIONS.pop(session, None)
        try:
            await websocket.close()
        except (RuntimeError, WebSocketDisconnect):  # closed already, or the client is gone
            pass


def start(port: int, timeout_s: float = 30.0, max_sessions: int | None = None) -> subprocess.Popen:
    """This app under uvicorn in a subprocess on ``127.0.0.1:port``, once ``/health`` answers, with at most
    ``max_sessions`` ``/ws`` sessions (default :data:`MAX_SESSIONS`); the child dies with its parent.

    Raises:
        RuntimeError: it exited or did not answer within ``timeout_s`` (it is stopped first).
    """
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.support.openenv_server:app", "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                            preexec_fn=die_with_parent(),
                            env={**os.environ, **({} if max_sessions is None else
                                                  {"WORD_GAME_MAX_SESSIONS": str(max_sessions)})})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"the word-game server on port {port} did not start (exit code {proc.returncode})")


def stop(proc: subprocess.Popen) -> None:
    """Stop a server :func:`start` started: SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
