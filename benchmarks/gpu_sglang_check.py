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
4. prints tokens/s of the generation and one JSON line; stops the server by its pid.

It needs a GPU, so it is not part of the test suite; CI checks the same engine against
``rollout_service/torch_sglang_server.py``.
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
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
                               "--port", str(args.port), "--tp", str(args.tp), "--weight-version", "0"],
                              start_new_session=True)
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
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    print(json.dumps(report, default=str, indent=2))


if __name__ == "__main__":
    main()
