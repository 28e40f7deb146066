"""The null engine (``rollout.engine: null``): completions without a model at a set token rate."""

from __future__ import annotations

import math
import time

from rollout_service.config import RolloutSettings
from rollout_service.engine import GenerationRequest
from rollout_service.main import build_engine
from rollout_service.null_engine import NullEngine, NullTokenizer
from shared.model import encode_chat
from shared.schemas import SamplingParams, WeightUpdate


def test_completions_have_the_budget_of_tokens_uniform_logprobs_and_the_engine_version():
    eng = NullEngine(vocab=16, seed=3)
    eng.update_weights(WeightUpdate(model="m", version=5, step=5, manifest=[], checksum="null:"))
    out = eng.generate([GenerationRequest([1, 2], 3, SamplingParams(max_new_tokens=6)),
                        GenerationRequest([3], 2, SamplingParams(max_new_tokens=2))])
    assert [len(s) for s in out] == [3, 2]
    for s in out[0]:
        assert len(s.completion_ids) == 6 and all(0 <= i < 16 for i in s.completion_ids)
        assert s.logprobs == [-math.log(16)] * 6 and s.finish_reason == "length"
        assert [(v.version, v.start, v.end) for v in s.versions] == [(5, 0, 6)]
    fixed = NullEngine(vocab=4, completion="fixed").generate([GenerationRequest([1], 2, SamplingParams(max_new_tokens=5))])
    assert [s.completion_ids for s in fixed[0]] == [[0, 1, 2, 3, 0]] * 2


def test_the_token_rate_is_per_sample_or_per_batch():
    req = [GenerationRequest([1], 4, SamplingParams(max_new_tokens=10))]
    t0 = time.perf_counter()
    NullEngine(tokens_per_s=100, rate_per="sample").generate(req)  # 10 tokens at 100/s, samples in parallel
    per_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    NullEngine(tokens_per_s=400, rate_per="batch").generate(req)  # 40 tokens at 400/s
    per_batch = time.perf_counter() - t0
    assert 0.09 <= per_sample < 0.5 and 0.09 <= per_batch < 0.5


def test_the_service_builds_it_without_a_model_directory():
    cfg = RolloutSettings(model={"name": "/nonexistent/model"}, rollout={"engine": "null", "null_vocab": 32})
    eng, tok = build_engine(cfg)
    assert isinstance(eng, NullEngine) and isinstance(tok, NullTokenizer)
    ids = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert ids and all(0 <= i < 32 for i in ids) and tok.decode([0, 1, 27]) == "abb"
