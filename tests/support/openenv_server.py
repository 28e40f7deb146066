"""A tiny OpenEnv-compatible server for the tests and the guide: a word-guessing game over ``POST /reset``,
``POST /step``, ``GET /state`` and ``GET /health``, one episode per process (as an OpenEnv server without
sessions plays it).

``POST /reset`` takes ``{}`` or any of ``seed`` (picks the word from :data:`WORDS`), ``episode_id``, ``word`` (the
word itself), ``hint_reward`` (the reward of a wrong guess, default 0), ``max_attempts`` (default 5) and ``fail``
(``"500"``: answer HTTP 500; ``"garbage"``: answer 200 with a body that is not JSON). ``POST /step`` takes
``{"action": {"message": "<guess>"}}``: the guess that is the word (ignoring case and surrounding spaces and
punctuation) earns 1.0 and ends the episode; a wrong one earns ``hint_reward`` and a hint, and the last allowed
attempt ends it. The messages ``boom``, ``garbage`` and ``slow`` answer HTTP 500, a body that is not JSON, and
after 3 s. Answers are ``{"observation": {"message", "attempts_left", "length"}, "reward", "done"}``.

Run it: ``python -m uvicorn tests.support.openenv_server:app --port 8011`` from the repository root, or
:func:`start` (a subprocess) and :func:`stop`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from flywheel.broker import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("cat", "dog", "owl", "fox", "bee", "elk")
"""The words ``seed`` picks from (``WORDS[seed % 6]``)."""

app = FastAPI(title="word game (OpenEnv protocol)")
GAME: dict[str, Any] = {"word": None, "attempts_left": 0, "hint_reward": 0.0, "episode_id": None, "steps": 0,
                        "done": True}
"""The one episode this process plays."""


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


def _answer(message: str, reward: float | None) -> dict[str, Any]:
    return {"observation": {"message": message, "attempts_left": GAME["attempts_left"], "length": len(GAME["word"])},
            "reward": reward, "done": GAME["done"]}


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
    word = body.word or WORDS[(body.seed or 0) % len(WORDS)]
    GAME.update(word=word.lower(), attempts_left=body.max_attempts, hint_reward=body.hint_reward, steps=0,
                episode_id=body.episode_id or uuid.uuid4().hex, done=False)
    return _answer(f"Guess my {len(word)}-letter word.", None)


@app.post("/step")
async def step(body: StepBody):
    message = body.action.get("message")
    if not isinstance(message, str):
        raise HTTPException(422, "action needs a 'message' string")
    if (bad := _misbehave(message.strip())) is not None:
        return bad
    if message.strip() == "slow":
        await asyncio.sleep(3)
    if GAME["done"]:
        raise HTTPException(409, "the episode is over; POST /reset")
    GAME["steps"] += 1
    guess = message.strip().strip(".!?\"' ").lower()
    if guess == GAME["word"]:
        GAME["done"] = True
        return _answer("Correct!", 1.0)
    GAME["attempts_left"] -= 1
    GAME["done"] = GAME["attempts_left"] == 0
    in_place = sum(a == b for a, b in zip(guess, GAME["word"]))
    return _answer(f"No. {in_place} of {len(GAME['word'])} letters in place.", GAME["hint_reward"])


@app.get("/state")
async def state():
    return {"episode_id": GAME["episode_id"], "step_count": GAME["steps"], "done": GAME["done"]}


@app.get("/health")
async def health():
    return {"status": "healthy"}


def start(port: int, timeout_s: float = 30.0) -> subprocess.Popen:
    """This app under uvicorn in a subprocess on ``127.0.0.1:port``, once ``/health`` answers; the child dies
    with its parent.

    Raises:
        RuntimeError: it exited or did not answer within ``timeout_s`` (it is stopped first).
    """
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.support.openenv_server:app", "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                            preexec_fn=die_with_parent())
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
