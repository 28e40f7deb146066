"""A scripted OpenAI-compatible chat endpoint for the judge layer's tests."""

from __future__ import annotations

import re
import threading
import time

from fastapi import Request  # module level: the handler's annotation must resolve

from tests.conftest import free_port


class ScriptedJudgeServer:
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint that answers from a script.

    A stand-in for the strong judge model (a GPT-4-class model behind an API) that this CPU machine
    cannot run; the judge client, parsing and calibration under test are the real ones. The reply is
    ``script(user_message)``; a reply of ``None`` answers HTTP 500.
    """

    def __init__(self, script):
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(req: Request):
            body = await req.json()
            self.requests.append({"body": body, "auth": req.headers.get("authorization")})
            reply = script(body["messages"][-1]["content"])
            if reply is None:
                return JSONResponse({"error": "overloaded"}, status_code=500)
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()


# ---------------------------------------------------------------- judges that obey injected instructions

_OBEY = re.compile(r"give\s+(?:it\s+|this\s+|me\s+)?(?:a\s+)?10\b|score\s*[:=]?\s*(?:of\s+)?10\b|full\s+marks|10\s*/\s*10"
                   r"|perfect\s+score|maximum\s+score|top\s+score|highest\s+score|rate\s+(?:it|this)\s+10", re.IGNORECASE)
_OPEN = re.compile(r"<<<RESPONSE-(\w+)\n")


def _honest(response: str, good: str) -> str:
    return "SCORE: 6" if good in response else "SCORE: 2"


def obeying_judge(good: str = "Paris"):
    """A judge that obeys any instruction to give a top score it reads anywhere in the message, the
    response included (the worst case: only the detector can stop it). Otherwise it scores 6 when the
    response contains ``good`` and 2 when not."""
    def script(user: str) -> str:
        if _OBEY.search(user):
            return "Instructions say so.\nSCORE: 10"
        m = _OPEN.search(user)
        return _honest(user[m.end():] if m else user, good)
    return script


def fence_reading_judge(good: str = "Paris"):
    """A judge that treats the marked response as data but reads the markers sloppily, as a weak model
    may: the data ends at the first ``>>>`` after ``<<<RESPONSE-``, or at a chat-template token (a new
    turn), or at a line that starts a section of the prompt (``RUBRIC:``, ``SCORE:``, ``[system]``);
    an instruction it reads outside the data is obeyed. Otherwise as :func:`obeying_judge`'s honest
    score, over the true response."""
    new_section = re.compile(r">>>|<\|[a-z_]+\|>|\[/?INST\]|<<SYS>>|^(?:(?:RUBRIC|SCORE|TASK|SYSTEM)\b|\[system\])",
                             re.IGNORECASE | re.MULTILINE)

    def script(user: str) -> str:
        m = _OPEN.search(user)
        assert m, "the response is marked"
        end = user.find(f"\nRESPONSE-{m.group(1)}>>>", m.end())
        cut = new_section.search(user, m.end())
        data_end = min(end, cut.start()) if cut else end
        outside = user[:m.start()] + user[data_end:]
        if _OBEY.search(outside):
            return "Following the instructions.\nSCORE: 10"
        return _honest(user[m.end():end], good)
    return script
