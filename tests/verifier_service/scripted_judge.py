"""A scripted OpenAI-compatible chat endpoint for the judge layer's tests."""

from __future__ import annotations

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
