"""Test double: a stand-in for a GPU SGLang server, speaking SGLang's HTTP API, backed by the torch engine.

**Not SGLang, and not part of the product.** This CPU machine cannot run SGLang (it needs a GPU
build), so the tests check
:class:`rollout_service.sglang_engine.SGLangEngine` against this server, which answers the subset of
SGLang's API that the engine uses, with SGLang's request and response shapes
(../shared/notes/sglang-api.md): ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``;
``meta_info.output_token_logprobs``, ``finish_reason``, ``weight_version``, ``weight_versions``),
``/update_weights_from_disk``, ``/pause_generation`` (``abort``, SGLang's default: running requests
end at once with ``finish_reason.type == "abort"`` and their partial output; ``retract``: they continue
under the new weights, their cache recomputed; ``in_place``: they continue under the new weights on
the old cache), ``/continue_generation``, ``/health``, ``/health_generate`` (503 while paused),
``/model_info``, ``/server_info``, ``/update_weight_version``, ``/flush_cache``, and the broadcast path:
``/init_weights_update_group`` (joins the trainer's store as SGLang's ``init_custom_process_group``
does; gloo here, NCCL in SGLang), ``/update_weights_from_distributed`` (per-tensor or
``flattened_bucket``), ``/destroy_weights_update_group`` and, as 0.5.21+ requires around distributed
updates, ``/begin_weight_update`` / ``/end_weight_update`` (``require_begin=False`` emulates ≤ 0.5.19,
which has neither). Buckets are staged and loaded together when the bucket carrying
``weight_version`` (or ``/continue_generation``) arrives; SGLang loads each at once, which is the
same while generation is paused. The real server is checked by ``benchmarks/gpu_sglang_check.py``
on a GPU machine.

From the repository root (``tests`` is a namespace package there; tests/e2e/test_cli.py starts it
this way, with ``cwd`` the repository root)::

    python -m tests.support.torch_sglang_server MODEL_DIR --port 30000

In process: ``uvicorn.Server(uvicorn.Config(build_app(engine, model_dir), ...))``
(tests/rollout_service/test_sglang_engine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout_service.engine import GenerationRequest
from rollout_service.sglang_engine import parse_weight_version
from rollout_service.torch_engine import TorchEngine
from shared.model import load_model, load_tokenizer
from shared.schemas import SamplingParams
from shared.weight_sync import join_group, leave_group

GROUP_TIMEOUT_S = 60.0
"""Default bound on forming a broadcast group and on each of its collectives (seconds)."""


def _load_dir(model: torch.nn.Module, path: str) -> None:
    """Load the ``*.safetensors`` under ``path`` (or the file ``path``) into ``model`` (non-strict).

    Raises:
        FileNotFoundError: no safetensors file there.
    """
    from safetensors.torch import load_file

    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors under {path}")
    for f in files:
        model.load_state_dict(load_file(str(f)), strict=False)


def refuse(message: str) -> JSONResponse:
    """HTTP 400 ``{"success": false, "message": ...}``, as SGLang answers a failed update."""
    return JSONResponse({"success": False, "message": message}, 400)


def _sample_json(engine: TorchEngine, prompt: list[int], s) -> dict:
    """One ``/generate`` result in SGLang's shape (``meta_info`` with per-token log-probs and version spans)."""
    reason = ({"type": "stop", "matched": s.completion_ids[-1]} if s.finish_reason == "stop"
              else {"type": "abort", "message": "Abort by pause_generation.", "status_code": 200,
                    "err_type": None} if s.finish_reason == "abort"
              else {"type": "length", "length": len(s.completion_ids)})
    return {"text": engine.tokenizer.decode(s.completion_ids), "output_ids": s.completion_ids,
            "meta_info": {
                "id": f"r{time.monotonic_ns()}", "finish_reason": reason,
                "prompt_tokens": len(prompt), "completion_tokens": len(s.completion_ids),
                "weight_version": str(s.versions[-1].version),
                "weight_versions": [{"version": str(v.version), "start": v.start, "end": v.end} for v in s.versions],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.completion_ids)],
            }}


class _StandIn:
    """The server's state and its blocking work (called from worker threads by the routes).

    ``state``: ``paused`` (generation held), ``version`` (the weight version string), ``in_flight``
    (generations running), ``updating`` (between ``/begin_weight_update`` and ``/end_weight_update``),
    ``mode`` (the last pause mode). ``groups``: broadcast process groups by name. ``staged``: received
    tensors by parameter name, not yet loaded. ``cond`` guards ``paused`` and ``in_flight``.
    """

    def __init__(self, engine: TorchEngine, model_path: str, require_begin: bool, group_timeout_s: float) -> None:
        self.engine, self.model_path = engine, model_path
        self.require_begin, self.group_timeout_s = require_begin, group_timeout_s
        self.state: dict[str, Any] = {"paused": False, "version": "0", "in_flight": 0, "updating": False,
                                      "mode": "abort"}
        self.groups: dict[str, Any] = {}
        self.staged: dict[str, torch.Tensor] = {}
        self.cond = threading.Condition()

    def generate(self, body: dict) -> list[dict]:
        """A ``/generate`` body's results, one per prompt copy (waits while paused); blocking."""
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
        with self.cond:
            while self.state["paused"]:
                self.cond.wait()
            self.state["in_flight"] += 1
        try:
            results = self.engine.generate(gen)
        finally:
            with self.cond:
                self.state["in_flight"] -= 1
                self.cond.notify_all()
        return [_sample_json(self.engine, p, s) for (p, _, _), samples in zip(reqs, results) for s in samples]

    def apply(self, loader) -> None:
        """Run ``loader`` between two decode steps of the generation in flight (retract: it continues under
        the new weights; in_place: on its old cache), or now when none is; blocking (600 s at most)."""
        engine = self.engine
        engine.request_interrupt(loader, recompute=self.state["mode"] != "in_place")
        deadline = time.monotonic() + 600
        while engine.has_pending and time.monotonic() < deadline:
            with self.cond:
                if self.state["in_flight"] == 0:
                    break  # idle, or the generation ended (finished, aborted) without a step boundary left
            time.sleep(0.005)
        engine.serve_pending()  # no-op when the generation took it

    def apply_staged(self, version: str) -> None:
        """Load every staged tensor and switch to ``version``; blocking."""
        weights = dict(self.staged)  # names and shapes were checked when their bucket was requested
        self.staged.clear()

        def loader() -> int:
            self.engine.model.load_state_dict(weights, strict=False)
            return parse_weight_version(version)

        self.apply(loader)
        self.state["version"] = version

    def load_from_disk(self, model_path: str, version: str) -> None:
        """``/update_weights_from_disk``: load ``model_path`` as ``version``; blocking. Staged buckets of
        a failed session are dropped (the disk load supersedes them, as it does in SGLang)."""

        def loader() -> int:
            _load_dir(self.engine.model, model_path)
            return parse_weight_version(version)

        self.staged.clear()
        self.apply(loader)
        self.state["version"] = version

    def join(self, b: dict):
        """Join the trainer's store at ``b["master_address"]:b["master_port"]`` as rank ``b["rank_offset"]``
        of ``b["world_size"]`` and form group ``b["group_name"]``; blocking. Returns the process group."""
        store, _, _ = next(dist.rendezvous(f"tcp://{b['master_address']}:{b['master_port']}", b["rank_offset"],
                                           b["world_size"], timeout=timedelta(seconds=self.group_timeout_s)))
        return join_group(store, b.get("group_name", "weight_update_group"), b["rank_offset"], b["world_size"],
                          b.get("backend", "nccl"), self.group_timeout_s)

    def bucket_specs(self, b: dict) -> list[tuple[str, torch.dtype, torch.Size]]:
        """``(name, dtype, shape)`` of each tensor of an ``/update_weights_from_distributed`` body.

        Raises:
            KeyError, TypeError, ValueError, AttributeError: lengths differ, a dtype is not a torch dtype
                name, or a name or shape is not the model's.
        """
        names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), list(b["shapes"])
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        specs = [(n, getattr(torch, d), torch.Size(s)) for n, d, s in zip(names, dtypes, shapes)]
        if not all(isinstance(d, torch.dtype) for _, d, _ in specs):
            raise ValueError("a dtype is not a torch dtype name")
        known = self.engine.model.state_dict()
        bad = [n for n, _, s in specs if n not in known or known[n].shape != s]
        if bad:
            raise ValueError(f"unknown parameter names or wrong shapes: {bad[:3]}")
        return specs

    def receive(self, b: dict, specs: list[tuple[str, torch.dtype, torch.Size]], pg) -> None:
        """Receive one bucket from rank 0 of ``pg`` (one flattened ``uint8`` tensor, or one broadcast per
        tensor) into ``staged``; load all staged tensors when the body carries ``weight_version``; blocking.

        Raises:
            RuntimeError, ValueError, torch.distributed.DistError: the collective failed.
        """
        if b.get("load_format") == "flattened_bucket":
            sizes = [s.numel() * d.itemsize for _, d, s in specs]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=pg)
            off = 0
            for (n, d, s), size in zip(specs, sizes):
                self.staged[n] = buf[off:off + size].view(d).view(s).clone()
                off += size
        else:
            for n, d, s in specs:
                t = torch.empty(s, dtype=d)
                dist.broadcast(t, src=0, group=pg)
                self.staged[n] = t
        if b.get("weight_version") is not None:
            self.apply_staged(str(b["weight_version"]))


def _generation_routes(app: FastAPI, s: _StandIn) -> None:
    """``/generate``, ``/pause_generation``, ``/continue_generation``."""

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        out = await asyncio.to_thread(s.generate, body)
        single = body["input_ids"] and not isinstance(body["input_ids"][0], list)
        return out[0] if single else out

    @app.post("/pause_generation")
    async def pause(req: Request):
        mode = (await req.json() if await req.body() else {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return refuse(f"unknown pause mode {mode!r}")
        with s.cond:
            s.state["paused"], s.state["mode"] = True, mode
            if mode == "abort" and s.state["in_flight"]:
                s.engine.request_abort()
        return {"success": True}

    @app.post("/continue_generation")
    async def resume(req: Request):
        problem = None
        if s.staged:  # buckets without a closing weight_version
            try:
                await asyncio.to_thread(s.apply_staged, s.state["version"])
            except (RuntimeError, ValueError) as e:
                problem = str(e)
        with s.cond:
            s.state["paused"] = False
            s.cond.notify_all()
        return refuse(f"resumed without the staged weights: {problem}") if problem else {"success": True}


def _weight_routes(app: FastAPI, s: _StandIn) -> None:
    """``/update_weights_from_disk`` and the broadcast path (group init/destroy, buckets, begin/end)."""

    @app.post("/update_weights_from_disk")
    async def update(req: Request):
        body = await req.json()
        try:
            await asyncio.to_thread(s.load_from_disk, body["model_path"],
                                    str(body.get("weight_version") or s.state["version"]))
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            return refuse(str(e))
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    @app.post("/init_weights_update_group")
    async def init_group(req: Request):
        b = await req.json()
        name = b.get("group_name", "weight_update_group")
        if name in s.groups:
            return refuse(f"group {name} already exists")
        try:
            s.groups[name] = await asyncio.to_thread(s.join, b)
        except (RuntimeError, ValueError, KeyError, TypeError, dist.DistError) as e:
            return refuse(f"failed to init group: {e}")
        return {"success": True, "message": "ok"}

    @app.post("/update_weights_from_distributed")
    async def update_distributed(req: Request):
        b = await req.json()
        if s.require_begin and not s.state["updating"]:  # as SGLang 0.5.21+ answers
            return refuse("call /begin_weight_update before a distributed update")
        pg = s.groups.get(b.get("group_name", "weight_update_group"))
        if pg is None:
            return refuse(f"group {b.get('group_name')} not initialised")
        try:
            specs = s.bucket_specs(b)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return refuse(f"bad request: {e}")
        try:
            await asyncio.to_thread(s.receive, b, specs, pg)
        except (RuntimeError, ValueError, dist.DistError) as e:
            return refuse(f"Failed to update parameter online: {e}")
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: Request):
        pg = s.groups.pop((await req.json()).get("group_name", "weight_update_group"), None)
        if pg is None:
            return refuse("no such group")
        leave_group(pg)
        return {"success": True, "message": "ok"}

    if s.require_begin:
        @app.post("/begin_weight_update")
        async def begin():
            s.state["updating"] = True
            return {"success": True, "message": "ok"}

        @app.post("/end_weight_update")
        async def end():
            s.state["updating"] = False
            return {"success": True, "message": "ok"}


def _info_routes(app: FastAPI, s: _StandIn) -> None:
    """``/update_weight_version``, ``/flush_cache``, ``/health``, ``/health_generate``, ``/server_info``,
    ``/model_info``."""

    @app.post("/update_weight_version")
    async def set_version(req: Request):
        s.state["version"] = str((await req.json())["new_version"])
        return {"success": True}

    @app.post("/flush_cache")
    async def flush():
        return {"success": True}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return JSONResponse({"status": "paused"}, 503) if s.state["paused"] else {"status": "ok"}

    @app.get("/server_info")
    async def server_info():
        return {"tp_size": 1, "dp_size": 1, "model_path": s.model_path, "weight_version": s.state["version"]}

    @app.get("/model_info")
    async def model_info():
        return {"model_path": s.model_path, "weight_version": s.state["version"], "is_generation": True}


def build_app(engine: TorchEngine, model_path: str = "", require_begin: bool = True,
              group_timeout_s: float = GROUP_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving ``engine`` with SGLang's HTTP contract (see the module docstring);
    ``require_begin=False`` answers like SGLang ≤ 0.5.19 (no begin/end endpoints); ``group_timeout_s``
    bounds forming a broadcast group and each of its collectives (seconds)."""
    app = FastAPI(title="torch-backed SGLang stand-in (test double, not SGLang)")
    s = _StandIn(engine, model_path, require_begin, group_timeout_s)
    for add_routes in (_generation_routes, _weight_routes, _info_routes):
        add_routes(app, s)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description="torch-backed stand-in for a GPU SGLang server (test double, not SGLang)")
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    args = ap.parse_args()
    import uvicorn

    engine = TorchEngine(load_model(Path(args.model_dir)), load_tokenizer(Path(args.model_dir)))
    uvicorn.run(build_app(engine, args.model_dir), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
