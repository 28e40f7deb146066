"""The SGLang engine against the torch-backed stand-in server (SGLang's HTTP contract; not SGLang, which
needs a GPU: ``benchmarks/gpu_sglang_check.py`` checks the real one)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_service.engine import GenerationRequest
from rollout_service.sglang_engine import SGLangEngine
from rollout_service.torch_engine import TorchEngine
from rollout_service.torch_sglang_server import build_app
from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer
from shared.schemas import SamplingParams, WeightUpdate
from tests.conftest import free_port


@pytest.fixture
def server(tmp_path):
    import uvicorn

    d = build_tiny_model(tmp_path / "tiny")
    engine = TorchEngine(load_model(d), load_tokenizer(d), seed=0)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, str(d)), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine, d, tmp_path
    finally:
        srv.should_exit = True
        t.join(10)


def test_generate_returns_ids_logprobs_and_versions_token_in_token_out(server):
    url, backend, d, _ = server
    eng = SGLangEngine(url)
    assert eng.wait_ready(timeout_s=10)["weight_version"] == "0"
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "hi"}])
    out = eng.generate([GenerationRequest(p, 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)),
                        GenerationRequest(p[:-1], 1, SamplingParams(max_new_tokens=4, temperature=0.0))])
    assert [len(o) for o in out] == [3, 1]
    for prompt, group in ((p, out[0]), (p[:-1], out[1])):
        for s in group:
            assert 1 <= len(s.completion_ids) == len(s.logprobs) and s.finish_reason in ("stop", "length")
            assert [(v.version, v.start, v.end) for v in s.versions] == [(0, 0, len(s.completion_ids))]
    # the log-probs are the behaviour policy's at the sampling temperature
    s = out[0][0]
    with torch.no_grad():
        logits = backend.model(torch.tensor([p + s.completion_ids])).logits[0, len(p) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)
    eng.close()


def test_update_from_disk_pauses_loads_the_version_and_continues(server):
    url, backend, d, tmp = server
    eng = SGLangEngine(url)
    other = build_tiny_model(tmp / "other", seed=9)
    eng.update_weights(WeightUpdate(model="m", version=3, step=3, manifest=[], checksum="sha256:x", path=str(other)))
    assert eng.policy_version == 3 and eng.http.get("/model_info").json()["weight_version"] == "3"
    assert eng.http.get("/health_generate").status_code == 200  # continued after the update
    from safetensors.torch import load_file

    want = load_file(str(next(other.glob("*.safetensors"))))
    assert all(torch.equal(backend.model.state_dict()[k], v) for k, v in want.items() if k in backend.model.state_dict())
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "x"}])
    (s,) = eng.generate([GenerationRequest(p, 1, SamplingParams(max_new_tokens=3, temperature=0.0))])[0]
    assert s.versions[-1].version == 3
    eng.http.post("/pause_generation", json={"mode": "retract"})
    assert eng.http.get("/health_generate").status_code == 503  # paused, as SGLang reports it
    eng.http.post("/continue_generation", json={})
    bad = eng.http.post("/update_weights_from_disk", json={"model_path": str(tmp / "nothing"), "weight_version": "4"})
    assert bad.json()["success"] is False
    with pytest.raises(RuntimeError, match="could not load version 4"):
        eng.update_weights(WeightUpdate(model="m", version=4, step=4, manifest=[], checksum="sha256:x",
                                        path=str(tmp / "nothing")))
    assert eng.policy_version == 3 and eng.http.get("/health_generate").status_code == 200
    eng.close()


def test_an_update_during_generation_continues_it_under_the_new_version(server):
    url, backend, d, tmp = server
    backend.model.generation_config.eos_token_id = None
    backend.eos_ids = set()
    eng = SGLangEngine(url)
    other = build_tiny_model(tmp / "other", seed=9)
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "long"}])
    result = {}
    t = threading.Thread(target=lambda: result.update(out=eng.generate(
        [GenerationRequest(p, 2, SamplingParams(max_new_tokens=400, temperature=1.0, seed=1))])))
    t.start()
    time.sleep(0.3)  # the generation is under way
    eng.interrupt_with(WeightUpdate(model="m", version=1, step=1, manifest=[], checksum="sha256:x", path=str(other)))
    t.join(60)
    for s in result["out"][0]:
        assert len(s.completion_ids) == 400
        vs = [(v.version, v.start, v.end) for v in s.versions]
        assert [v for v, _, _ in vs] == [0, 1] and vs[0][1] == 0 and vs[0][2] == vs[1][1] and vs[1][2] == 400, vs
    eng.close()
