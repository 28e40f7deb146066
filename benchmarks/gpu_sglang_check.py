"""Check the SGLang engine against a real SGLang server on a GPU machine (SGLang installed: the ``gpu`` extra).

    python benchmarks/gpu_sglang_check.py --model /path/to/hf/model [--port 30000] [--tp 1]

Starts ``python -m sglang.launch_server --model-path MODEL --weight-version 0``, waits for
``/health_generate``, then through :class:`rollout_service.sglang_engine.SGLangEngine`:

1. generates K = 8 samples of 64 tokens for two prompts and checks that ids and log-probs come back
   for every token, with one version span each;
2. recomputes the log-probs with transformers on the GPU and prints the largest difference (SGLang's
   log-probs are of the tempered distribution when ``temperature`` is set: checked here at T = 1);
3. updates the weights from disk (the same model directory as version 1) while a long generation is
   running and checks that the spans carry versions 0 and 1;
4. runs one broadcast session as the trainer would (``shared/weight_sync.py``: this script is rank 0
   and hosts the store; the server joins through ``/init_weights_update_group`` and takes flattened
   buckets through ``/update_weights_from_distributed``), sending the model's own bf16 weights as
   version 2, and checks that greedy outputs are unchanged and tagged version 2;
5. prints tokens/s of the generation, the broadcast's seconds and GB/s, and one JSON report; stops the
   server by its pid.

The broadcast uses NCCL when the machine has two GPUs (the server on GPU 1, this script on GPU 0; NCCL
refuses two ranks on one device) and gloo otherwise (``--backend`` overrides).

It needs a GPU, so it is not part of the test suite; CI checks the same engine against
``tests/support/torch_sglang_server.py``, a torch-backed stand-in for the GPU server (a test double).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_service.engine import GenerationRequest  # noqa: E402
from rollout_service.sglang_engine import SGLangEngine  # noqa: E402
from shared.schemas import SamplingParams, WeightUpdate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    args = ap.parse_args()
    import torch

    two_gpus = torch.cuda.device_count() >= 2
    backend = args.backend or ("nccl" if two_gpus else "gloo")
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": "1"} if two_gpus else {}))
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
                               "--port", str(args.port), "--tp", str(args.tp), "--weight-version", "0"],
                              start_new_session=True, env=env)
    report: dict = {}
    try:
        eng = SGLangEngine(f"http://127.0.0.1:{args.port}")
        report["model_info"] = eng.wait_ready(timeout_s=900)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in ("Write a haiku about rivers.", "Explain binary search in two sentences.")]
        sp = SamplingParams(max_new_tokens=64, temperature=1.0)
        t0 = time.perf_counter()
        out = eng.generate([GenerationRequest(p, 8, sp) for p in prompts])
        dt = time.perf_counter() - t0
        n_tok = sum(len(s.completion_ids) for g in out for s in g)
        assert all(len(s.logprobs) == len(s.completion_ids) > 0 and len(s.versions) == 1 for g in out for s in g)
        report["tokens_per_s"] = n_tok / dt
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).cuda().eval()
        worst = 0.0
        for p, g in zip(prompts, out):
            for s in g[:2]:
                ids = torch.tensor([p + s.completion_ids]).cuda()
                with torch.no_grad():
                    logits = model(ids).logits[0, len(p) - 1:-1].float()
                ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids).cuda()[:, None])[:, 0]
                worst = max(worst, (ref.cpu() - torch.tensor(s.logprobs)).abs().max().item())
        report["max_logprob_diff_vs_transformers_bf16"] = worst
        del model
        result = {}
        th = threading.Thread(target=lambda: result.update(out=eng.generate(
            [GenerationRequest(prompts[0], 4, SamplingParams(max_new_tokens=1024, temperature=1.0))])))
        th.start()
        time.sleep(1.0)
        eng.interrupt_with(WeightUpdate(model="m", version=1, step=1, manifest=[], checksum="sha256:x", path=args.model))
        th.join(600)
        report["spans_after_interrupt"] = [[(v.version, v.start, v.end) for v in s.versions] for s in result["out"][0]]
        report["two_versions"] = all(len({v.version for v in s.versions}) == 2 for s in result["out"][0])
        report["broadcast"] = _broadcast_check(eng, args.model, prompts, backend)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    print(json.dumps(report, default=str, indent=2))


def _broadcast_check(eng: SGLangEngine, model_dir: str, prompts: list[list[int]], backend: str) -> dict:
    """One session of version 2 carrying the model's own weights: greedy outputs must not change."""
    import torch
    from transformers import AutoModelForCausalLM

    from flywheel.broker import free_port
    from shared.checkpoint import manifest
    from shared.model_weights import snapshot_weights
    from shared.weight_sync import WeightBroadcaster, WeightReceiver

    greedy = [GenerationRequest(p, 1, SamplingParams(max_new_tokens=32, temperature=0.0)) for p in prompts]
    before = [g[0].completion_ids for g in eng.generate(greedy)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    weights = {k: (v.cuda() if backend == "nccl" else v) for k, v in snapshot_weights(model).items()}
    port = free_port()
    bc = WeightBroadcaster("127.0.0.1", port, backend=backend, timeout_s=300)
    receiver = WeightReceiver("127.0.0.1", port, "sglang-check", timeout_s=300, backend=backend,
                              width=eng.broadcast_width)
    update = WeightUpdate(model="m", version=2, step=2, manifest=manifest(weights), checksum="sha256:x",
                          transport="distributed", receivers=["sglang-check"])
    bc.prepare(2, ["sglang-check"], weights)
    res: dict = {}
    th = threading.Thread(target=lambda: res.update(bc.broadcast(2, weights, ["sglang-check"])))
    th.start()
    rank, world = receiver.session(2)
    plan = receiver.plan(2)
    t0 = time.perf_counter()
    eng.receive_broadcast(update, rank, world, plan, "127.0.0.1", port, backend, 300)
    seconds = time.perf_counter() - t0
    th.join(300)
    receiver.close()
    after = eng.generate(greedy)
    return {"backend": backend, "ok": res.get("ok"), "error": res.get("error"), "seconds": seconds,
            "gb_per_s": res.get("bytes", 0) / 1e9 / max(seconds, 1e-9), "buckets": len(plan),
            "greedy_unchanged": [g[0].completion_ids for g in after] == before,
            "versions_after": [g[0].versions[-1].version for g in after]}


if __name__ == "__main__":
    main()
