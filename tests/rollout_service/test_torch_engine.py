import pytest
import torch

from rollout_service.engine import GenerationRequest
from rollout_service.torch_engine import TorchEngine
from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer
from shared.schemas import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _engine(d):
    torch.set_num_threads(1)
    return TorchEngine(load_model(d), load_tokenizer(d), seed=1)


def test_samples_logprobs_match_a_full_forward(tiny_dir):
    eng = _engine(tiny_dir)
    tok = eng.tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": "hi"}]),
               encode_chat(tok, [{"role": "user", "content": "a longer prompt"}])]
    reqs = [GenerationRequest(p, 3, SamplingParams(max_new_tokens=6, temperature=1.0)) for p in prompts]
    out = eng.generate(reqs)
    assert [len(o) for o in out] == [3, 3]
    for p, samples in zip(prompts, out):
        for s in samples:
            assert 1 <= len(s.completion_ids) <= 6 and len(s.logprobs) == len(s.completion_ids)
            assert s.finish_reason in ("stop", "length")
            assert s.versions[0].version == 0 and s.versions[0].end == len(s.completion_ids)
            ids = torch.tensor([p + s.completion_ids])
            with torch.no_grad():
                logits = eng.model(ids).logits[0, len(p) - 1:-1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)


def test_greedy_is_deterministic_and_temperature_scales_logprobs(tiny_dir):
    eng = _engine(tiny_dir)
    p = encode_chat(eng.tokenizer, [{"role": "user", "content": "x"}])
    g1 = eng.generate([GenerationRequest(p, 2, SamplingParams(max_new_tokens=5, temperature=0.0))])[0]
    g2 = eng.generate([GenerationRequest(p, 1, SamplingParams(max_new_tokens=5, temperature=0.0))])[0]
    assert g1[0].completion_ids == g1[1].completion_ids == g2[0].completion_ids
    hot = eng.generate([GenerationRequest(p, 1, SamplingParams(max_new_tokens=5, temperature=2.0, seed=3))])[0][0]
    ids = torch.tensor([p + hot.completion_ids])
    with torch.no_grad():
        logits = eng.model(ids).logits[0, len(p) - 1:-1] / 2.0
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(hot.completion_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(hot.logprobs), ref, atol=1e-4, rtol=1e-4)
