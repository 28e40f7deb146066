import pytest
import torch

from rollout_service.engine import GenerationRequest
from rollout_service.torch_engine import TorchEngine
from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer
from shared.schemas import SamplingParams

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32/64 references


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


def test_requests_of_different_token_limits_decode_as_one_batch_each_to_its_own_limit(tiny_dir):
    """A multi-turn rollout's later turns ask for what their budget has left: requests of one distribution but
    different ``max_new_tokens`` share one batch, and each row stops at its own limit (finish ``length``) with the
    tokens it would have had alone."""
    eng = _engine(tiny_dir)
    eng.eos_ids = set()  # no early stop: every row runs to its limit
    p = encode_chat(eng.tokenizer, [{"role": "user", "content": "x"}])
    q = encode_chat(eng.tokenizer, [{"role": "user", "content": "another one"}])
    alone = eng.generate([GenerationRequest(p, 1, SamplingParams(max_new_tokens=9, temperature=0.0))])[0][0]
    before = eng.batches
    short, long_, other = eng.generate([GenerationRequest(p, 2, SamplingParams(max_new_tokens=3, temperature=0.0)),
                                        GenerationRequest(p, 1, SamplingParams(max_new_tokens=9, temperature=0.0)),
                                        GenerationRequest(q, 1, SamplingParams(max_new_tokens=5, temperature=0.0))])
    assert eng.batches == before + 1
    assert [len(s.completion_ids) for s in short + long_ + other] == [3, 3, 9, 5]
    assert all(s.finish_reason == "length" and len(s.logprobs) == len(s.completion_ids) for s in short + long_ + other)
    assert short[0].completion_ids == alone.completion_ids[:3] and long_[0].completion_ids == alone.completion_ids
    assert short[0].versions[-1].end == 3


def test_interrupted_generation_tags_each_token_with_its_version_and_trains_under_eta_1(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory
    from trainer_service.config import TrainerConfig
    from trainer_service.groups import GroupBuffer
    from trainer_service.trainer import PolicyTrainer

    eng = _engine(tiny_dir)
    old = {k: v.clone() for k, v in eng.model.state_dict().items()}
    new_dir = build_tiny_model(tmp_path / "other", seed=7)
    new = load_file(str(next(new_dir.glob("*.safetensors"))))
    p = encode_chat(eng.tokenizer, [{"role": "user", "content": "go"}])
    eng.model.generation_config.eos_token_id = None  # no early stop: every sample spans the update
    eng.eos_ids = set()

    def loader():
        eng.model.load_state_dict(new, strict=False)
        return 1

    eng.request_interrupt(loader)  # served at the first step boundary of the next generation
    (samples,) = eng.generate([GenerationRequest(p, 4, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))])
    assert eng.policy_version == 1 and eng.interrupts == 1
    for s in samples:
        assert len(s.completion_ids) == 12
        assert [(v.version, v.start, v.end) for v in s.versions] == [(0, 0, 1), (1, 1, 12)]
        # each token's log-prob is the one of the weights that produced it
        for state, lo, hi in ((old, 0, 1), (new, 1, 12)):
            ref_model = load_model(tiny_dir)
            ref_model.load_state_dict(state, strict=False)
            with torch.no_grad():
                logits = ref_model(torch.tensor([p + s.completion_ids])).logits[0, len(p) - 1:-1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(s.logprobs[lo:hi]), ref[lo:hi], atol=1e-4, rtol=1e-4)

    # the trainer (at version 1, η = 1) accepts the mixed-version group and trains on it
    task = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "go"}],
                verifier={"kind": "regex", "pattern": "a"})
    buf = GroupBuffer(max_staleness=1)
    for i, s in enumerate(samples):
        tr = Trajectory(trajectory_id=f"g:1:{i}", group_id="g", sample_index=i, group_size=4, task=task,
                        prompt_ids=p, completion_ids=s.completion_ids, completion_logprobs=s.logprobs,
                        loss_mask=[1] * len(s.completion_ids), completion_text="x", finish_reason=s.finish_reason,
                        policy_versions=s.versions)
        buf.add(ScoredTrajectory(trajectory=tr, reward=Reward(total=float(i % 2))), ("s", 0), i)
    trainer = PolicyTrainer(eng.model, TrainerConfig(), pad_id=0)
    trainer.version = 1
    assert buf.drop_stale(trainer.version) == 0  # oldest token from v0: staleness 1 ≤ η
    groups = buf.take(1)
    assert len(groups) == 1 and groups[0].behaviour_version == 0
    metrics = trainer.train_step(groups)
    assert trainer.version == 2 and torch.isfinite(torch.tensor(metrics["loss/pg"]))


def test_an_in_place_interrupt_keeps_the_stale_cache_and_an_abort_returns_partial_samples(tiny_dir, tmp_path):
    """``recompute=False`` (SGLang's in_place pause): tokens after the update are sampled from the new
    weights over the cache of the old ones, so their log-probs differ from a fresh forward under the new
    weights (which ``recompute=True`` matches, test above). ``request_abort`` ends the generation in flight
    with finish_reason "abort" and only the next generation runs normally."""
    from safetensors.torch import load_file

    eng = _engine(tiny_dir)
    new = load_file(str(next(build_tiny_model(tmp_path / "other", seed=7).glob("*.safetensors"))))
    p = encode_chat(eng.tokenizer, [{"role": "user", "content": "go"}])
    eng.model.generation_config.eos_token_id = None
    eng.eos_ids = set()

    def loader():
        eng.model.load_state_dict(new, strict=False)
        return 1

    eng.request_interrupt(loader, recompute=False)
    (samples,) = eng.generate([GenerationRequest(p, 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))])
    fresh = load_model(tiny_dir)
    fresh.load_state_dict(new, strict=False)
    for s in samples:
        assert [(v.version, v.start, v.end) for v in s.versions] == [(0, 0, 1), (1, 1, 12)]
        with torch.no_grad():
            logits = fresh(torch.tensor([p + s.completion_ids])).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        assert not torch.allclose(torch.tensor(s.logprobs[1:]), ref[1:], atol=1e-3)  # stale keys and values

    eng.request_abort()  # as the stand-in does while a generation is in flight
    (aborted,) = eng.generate([GenerationRequest(p, 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))])
    assert all(s.finish_reason == "abort" and s.completion_ids == [] for s in aborted)
    (normal,) = eng.generate([GenerationRequest(p, 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))])
    assert all(s.finish_reason == "length" and len(s.completion_ids) == 12 for s in normal)


def test_sample_categorical_draws_in_proportion_and_never_a_zero_probability_token():
    from rollout_service.torch_engine import sample_categorical

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 20_000)  # rows need not be normalised:
    probs[10_000:] *= 7.0  # half of them sum to 7
    gen = torch.Generator().manual_seed(0)
    tok = sample_categorical(probs, gen)
    assert tok.shape == (20_000,) and tok.dtype == torch.long
    counts = torch.bincount(tok, minlength=6).double() / 20_000
    assert counts[[0, 2, 5]].sum() == 0  # zero-probability tokens never drawn
    # 4 standard errors of a proportion at n = 20,000 is under 0.015
    torch.testing.assert_close(counts[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.015, rtol=0)
    edge = torch.tensor([[0.25, 0.75, 0.0, 0.0]])  # whatever u is, never past the last positive token
    assert all(int(sample_categorical(edge, gen)) in (0, 1) for _ in range(200))


def test_rollout_attention_reaches_the_engine_and_eager_samples_what_sdpa_does(tiny_dir):
    """``rollout.attention: eager`` loads the engine's model with eager attention, and its
    samples and behaviour log-probs are those of the default ``sdpa`` engine (fp32, same seed), left-padded
    prompts of different lengths included."""
    from rollout_service.config import RolloutSettings
    from rollout_service.main import build_engine

    engines = {}
    for kernel in ("sdpa", "eager"):
        cfg = RolloutSettings(model={"name": str(tiny_dir)}, rollout={"attention": kernel, "seed": 4})
        engines[kernel], tok = build_engine(cfg)
        assert engines[kernel].model.config._attn_implementation == kernel
    prompts = [encode_chat(tok, [{"role": "user", "content": "hi"}]),
               encode_chat(tok, [{"role": "user", "content": "a much longer prompt than the first"}])]
    reqs = [GenerationRequest(p, 4, SamplingParams(max_new_tokens=8, temperature=1.0, seed=9)) for p in prompts]
    sdpa, eager = (engines[k].generate(reqs) for k in ("sdpa", "eager"))
    for a_group, b_group in zip(sdpa, eager):
        for a, b in zip(a_group, b_group):
            assert a.completion_ids == b.completion_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


def test_an_int8_engine_samples_from_an_int8_copy_rebuilt_after_each_weight_load(tiny_dir, tmp_path):
    """``quantization: int8``: log-probs are the int8 copy's, and a weight load makes the next generation use an
    int8 copy of the new weights (a stale copy would serve the old policy). Activation scales are per batch, so
    a full-sequence forward agrees with the decode steps to about 1e-2, not exactly."""
    from rollout_service.quantize import int8_runner

    eng = TorchEngine(load_model(tiny_dir), load_tokenizer(tiny_dir), seed=1, quantization="int8")
    prompt = encode_chat(eng.tokenizer, [{"role": "user", "content": "hi"}])
    req = [GenerationRequest(prompt, 2, SamplingParams(max_new_tokens=6, temperature=1.0))]

    def scored(model, s) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s.completion_ids])).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]

    s = eng.generate(req)[0][0]
    assert eng.runner is not eng.model
    torch.testing.assert_close(torch.tensor(s.logprobs), scored(eng.runner, s), atol=3e-2, rtol=0)
    other = load_model(build_tiny_model(tmp_path / "other", seed=7))
    eng.load_weights_state(other.state_dict(), version=3)
    s = eng.generate(req)[0][0]
    assert s.versions[0].version == 3
    torch.testing.assert_close(torch.tensor(s.logprobs), scored(int8_runner(other), s), atol=3e-2, rtol=0)
    stale = scored(int8_runner(load_model(tiny_dir)), s)
    assert (torch.tensor(s.logprobs) - stale).abs().max() > 0.2
