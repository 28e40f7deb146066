"""A stand-in SGLang server for machines without a GPU: SGLang's HTTP contract, backed by the torch engine.

**Not SGLang.** This CPU machine cannot run SGLang (it needs a GPU build), so CI checks
:class:`rollout_service.sglang_engine.SGLangEngine` against this server, which answers the subset of
SGLang's API that the engine uses, with SGLang's request and response shapes
(../shared/notes/sglang-api.md): ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``;
``meta_info.output_token_logprobs``, ``finish_reason``, ``weight_version``, ``weight_versions``),
``/update_weights_from_disk``, ``/pause_generation`` (``retract``: running requests continue under
the new weights), ``/continue_generation``, ``/health``, ``/health_generate`` (503 while paused),
``/model_info``, ``/update_weight_version`` and ``/flush_cache``. The real server is checked by
``benchmarks/gpu_sglang_check.py`` on a GPU machine.

    python -m rollout_service.torch_sglang_server MODEL_DIR --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout_service.engine import GenerationRequest
from rollout_service.torch_engine import TorchEngine
from shared.model import load_model, load_tokenizer
from shared.schemas import SamplingParams


def _load_dir(model: torch.nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors under {path}")
    for f in files:
        model.load_state_dict(load_file(str(f)), strict=False)


def build_app(engine: TorchEngine, model_path: str = "") -> FastAPI:
    """The FastAPI app serving ``engine`` with SGLang's HTTP contract (see the module docstring)."""
    app = FastAPI(title="torch-backed SGLang stand-in (not SGLang)")
    state: dict[str, Any] = {"paused": False, "version": "0", "in_flight": 0}
    cond = threading.Condition()

    def _gen(body: dict) -> list[dict]:
        ids = body["input_ids"]
        ids = ids if ids and isinstance(ids[0], list) else [ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(ids)
        reqs: list[tuple[list[int], dict, int]] = []  # consecutive copies of a prompt share one prefill
        for p, sp in zip(ids, params):
            if reqs and reqs[-1][0] == p and reqs[-1][1] == sp:
                reqs[-1] = (p, sp, reqs[-1][2] + 1)
            else:
                reqs.append((p, sp, 1))
        gen = [GenerationRequest(p, n, SamplingParams(max_new_tokens=sp.get("max_new_tokens", 128),
                                                      temperature=sp.get("temperature", 1.0),
                                                      top_p=sp.get("top_p", 1.0), seed=sp.get("sampling_seed")))
               for p, sp, n in reqs]
        with cond:
            while state["paused"]:
                cond.wait()
            state["in_flight"] += 1
        try:
            groups = engine.generate(gen)
        finally:
            with cond:
                state["in_flight"] -= 1
                cond.notify_all()
        out = []
        for (p, _, _), samples in zip(reqs, groups):
            for s in samples:
                reason = ({"type": "stop", "matched": s.completion_ids[-1]} if s.finish_reason == "stop"
                          else {"type": "length", "length": len(s.completion_ids)})
                out.append({"text": engine.tokenizer.decode(s.completion_ids), "output_ids": s.completion_ids,
                            "meta_info": {
                                "id": f"r{time.monotonic_ns()}", "finish_reason": reason,
                                "prompt_tokens": len(p), "completion_tokens": len(s.completion_ids),
                                "weight_version": str(s.versions[-1].version),
                                "weight_versions": [{"version": str(v.version), "start": v.start, "end": v.end}
                                                    for v in s.versions],
                                "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.completion_ids)],
                            }})
        return out

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        out = await asyncio.to_thread(_gen, body)
        single = body["input_ids"] and not isinstance(body["input_ids"][0], list)
        return out[0] if single else out

    @app.post("/pause_generation")
    async def pause(req: Request):
        with cond:
            state["paused"] = True
        return {"success": True}

    @app.post("/continue_generation")
    async def resume(req: Request):
        with cond:
            state["paused"] = False
            cond.notify_all()
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update(req: Request):
        body = await req.json()
        version = str(body.get("weight_version") or state["version"])

        def loader() -> int:
            _load_dir(engine.model, body["model_path"])
            return int(version.lstrip("v") or 0)

        def apply() -> None:
            engine.request_interrupt(loader)  # running requests are retracted and continue with it
            with cond:
                idle = state["in_flight"] == 0
            if idle:
                engine.serve_pending()
            else:
                deadline = time.monotonic() + 600
                while engine.has_pending and time.monotonic() < deadline:
                    time.sleep(0.005)
                engine.serve_pending()  # the generation finished before a step boundary

        try:
            await asyncio.to_thread(apply)
        except (OSError, RuntimeError, ValueError) as e:
            return {"success": False, "message": str(e), "num_paused_requests": 0}
        state["version"] = version
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    @app.post("/update_weight_version")
    async def set_version(req: Request):
        state["version"] = str((await req.json())["new_version"])
        return {"success": True}

    @app.post("/flush_cache")
    async def flush():
        return {"success": True}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return JSONResponse({"status": "paused"}, 503) if state["paused"] else {"status": "ok"}

    @app.get("/model_info")
    async def model_info():
        return {"model_path": model_path, "weight_version": state["version"], "is_generation": True}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description="torch-backed SGLang stand-in (not SGLang)")
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    args = ap.parse_args()
    import uvicorn

    engine = TorchEngine(load_model(Path(args.model_dir)), load_tokenizer(Path(args.model_dir)))
    uvicorn.run(build_app(engine, args.model_dir), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
