import itertools
import math

import pytest
import torch

from shared.model import build_tiny_model, load_model
from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory
from trainer_service.config import TrainerConfig
from trainer_service.forward import PASS_COST_TOKENS, collate, completion_logprobs, length_buckets
from trainer_service.groups import GroupBuffer
from trainer_service.trainer import PolicyTrainer

TASK = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "q"}],
            verifier={"kind": "regex", "pattern": "^a"})

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32/64 references


def scored(gid, i, size=4, reward=1.0, version=0, comp=(5, 6, 7), lps=None, finish="stop", infra=False, mask=None,
           prompt=None):
    comp = list(comp)
    tr = Trajectory(trajectory_id=f"{gid}:1:{i}", group_id=gid, sample_index=i, group_size=size, task=TASK,
                    prompt_ids=list(prompt) if prompt else [1, 2, 3 + i % 2], completion_ids=comp,
                    completion_logprobs=list(lps) if lps else [-1.0] * len(comp),
                    loss_mask=list(mask) if mask else [1] * len(comp), completion_text="x", finish_reason=finish,
                    policy_versions=[{"version": version, "start": 0, "end": len(comp)}])
    return ScoredTrajectory(trajectory=tr, reward=Reward(total=reward, infra_error=infra))


def fill(buf, gid, rewards, **kw):
    for i, r in enumerate(rewards):
        buf.add(scored(gid, i, size=len(rewards), reward=r, **kw), ("s", 0), hash((gid, i)) % 10_000)


def test_group_buffer_skips_redelivered_and_already_trained_samples():
    buf = GroupBuffer(max_staleness=1)
    fill(buf, "g1", [1, 0, 1, 0])
    fill(buf, "g1", [1, 0, 1, 0])  # redelivery of the same records
    assert len(buf.ready) == 1 and buf.counters["duplicates_skipped"] == 4
    groups = buf.take(1)
    buf.mark_trained(groups)
    fill(buf, "g1", [1, 0, 1, 0])  # redelivery after training (e.g. after a restart)
    assert buf.ready == [] and buf.partial == {}
    restarted = GroupBuffer(max_staleness=1, done_groups=buf.done_groups)
    fill(restarted, "g1", [1, 0, 1, 0])
    assert restarted.ready == []


def test_failed_sample_drops_group_instead_of_zero_reward():
    buf = GroupBuffer(max_staleness=1)
    buf.add(scored("g", 0, size=2, reward=1.0), ("s", 0), 0)
    buf.add(scored("g", 1, size=2, reward=0.0, comp=(), finish="error"), ("s", 0), 1)
    assert buf.ready == [] and buf.counters["dropped_failed"] == 1
    buf2 = GroupBuffer(max_staleness=1)
    buf2.add(scored("h", 0, size=2, reward=0.0, infra=True), ("s", 0), 0)
    buf2.add(scored("h", 1, size=2), ("s", 0), 1)
    assert buf2.ready == [] and buf2.counters["dropped_failed"] == 1


def test_staleness_bound_keeps_eta_and_drops_eta_plus_one():
    buf = GroupBuffer(max_staleness=1)
    fill(buf, "fresh", [1, 0], version=4)
    fill(buf, "stale", [1, 0], version=3)
    assert buf.drop_stale(version=5) == 1
    assert [g.group_id for g in buf.ready] == ["fresh"] and buf.counters["dropped_stale"] == 1


def test_commit_offset_is_oldest_unfinished_record():
    buf = GroupBuffer(max_staleness=1)
    buf.add(scored("a", 0, size=2), ("s", 0), 10)
    buf.add(scored("b", 0, size=2), ("s", 0), 11)
    buf.add(scored("b", 1, size=2), ("s", 0), 12)
    assert buf.commit_offsets() == {("s", 0): 10}
    buf.mark_trained(buf.take(1))  # b
    assert buf.commit_offsets() == {("s", 0): 10}
    buf.add(scored("a", 1, size=2), ("s", 0), 13)
    buf.mark_trained(buf.take(1))
    assert buf.commit_offsets() == {("s", 0): 14}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _grads(tiny, micro, groups, agg="token_mean"):
    torch.manual_seed(0)
    model = load_model(tiny).double()
    cfg = TrainerConfig(micro_batch_size=micro, max_grad_norm=1e9, lr=1e-3, loss={"kind": "grpo", "loss_agg": agg})
    tr = PolicyTrainer(model, cfg, pad_id=0)
    tr.optimizer.step = lambda: None  # keep weights; inspect gradients
    tr.train_step(groups)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_gradient_does_not_depend_on_micro_batch_split(tiny, agg):
    buf = GroupBuffer(1)
    fill(buf, "g1", [1, 0, 0, 1], comp=(10, 11, 12, 13))
    fill(buf, "g2", [0.5, 0.0, 1.0, 0.2], comp=(20, 21))
    groups = buf.take(2)
    g1, g2, g4 = (_grads(tiny, m, groups, agg) for m in (8, 4, 2))
    # relative to the gradient's norm: HF computes RoPE angles in float32, so float64 runs of different
    # batch shapes agree to ~1e-8, not to float64 rounding
    assert g1.norm() > 0
    assert (g1 - g2).norm() / g1.norm() < 1e-6
    assert (g1 - g4).norm() / g1.norm() < 1e-6


def test_train_step_increments_version_and_all_equal_rewards_give_zero_gradient(tiny):
    model = load_model(tiny)
    tr = PolicyTrainer(model, TrainerConfig(), pad_id=0)
    buf = GroupBuffer(1)
    fill(buf, "g", [1, 1, 1, 1])
    m = tr.train_step(buf.take(1))
    assert tr.version == 1 and m["train/zero_variance_groups"] == 1.0
    assert m["train/grad_norm"] == 0.0 and m["loss/pg"] == 0.0


def test_trainer_logprobs_equal_a_plain_forward(tiny):
    model = load_model(tiny)
    rows = [scored("g", 0, comp=(5, 6, 7)), scored("g", 1, comp=(9,))]
    b = collate(rows, pad_id=0)
    with torch.no_grad():
        lp = completion_logprobs(model, b)
        for i, r in enumerate(rows):
            ids = torch.tensor([r.trajectory.prompt_ids + r.trajectory.completion_ids])
            logits = model(ids).logits[0, len(r.trajectory.prompt_ids) - 1:-1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.trajectory.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(lp[i, :len(ref)], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pass_cost", [PASS_COST_TOKENS, 0.0, math.inf])
def test_shared_prompt_logprobs_and_gradients_equal_separate_forwards(tiny, pass_cost):
    """Prefix sharing (one prompt pass per group) matches a plain full-sequence forward per row, whether the
    completions go in one padded pass (``inf``), one pass per distinct length (0) or the default split."""
    torch.manual_seed(0)
    model = load_model(tiny).double()
    rows = [scored("g", 0, comp=(5, 6, 7, 8)), scored("g", 2, comp=(9,)), scored("h", 1, comp=(11, 12)),
            scored("g", 4, comp=(13, 14, 15)), scored("k", 0, comp=(16, 17), prompt=(30, 31, 32, 33, 34))]
    b = collate(rows, pad_id=0)  # prompts: [1,2,3] x3 (indices 0,2,4), [1,2,4] x1 and one of length 5
    assert b.prompt_ids.shape[0] == 3
    lp = completion_logprobs(model, b, pass_cost=pass_cost)
    (lp * b.loss_mask).sum().backward()
    shared = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = 0
    for i, r in enumerate(rows):
        ids = torch.tensor([r.trajectory.prompt_ids + r.trajectory.completion_ids])
        logits = model(ids).logits[0, len(r.trajectory.prompt_ids) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.trajectory.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(lp[i, :len(ref)].detach(), ref.detach(), atol=1e-6, rtol=1e-6)
        total = total + ref.sum()
    total.backward()
    a = torch.cat([g.flatten() for g in shared])
    b = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (a - b).norm() / b.norm() < 1e-6  # float32 RoPE angles bound the agreement (see above)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_skipping_zero_advantage_rows_gives_the_full_batch_gradient(tiny, agg):
    """Rows of a zero-variance group skip the forward pass; the gradient equals the loss over every row."""
    from trainer_service.losses.config import GRPOLossConfig
    from trainer_service.losses.grpo import batch_normalizer, grpo_loss

    buf = GroupBuffer(1)
    fill(buf, "mixed", [1, 0, 0, 1], comp=(10, 11, 12, 13))
    fill(buf, "flat", [1, 1, 1, 1], comp=(20, 21))  # advantages exactly 0, shorter: changes the normaliser
    groups = buf.take(2)
    got = _grads(tiny, 8, groups, agg)
    torch.manual_seed(0)
    model = load_model(tiny).double()
    rows = [r for g in groups for r in g.rows()]
    adv = torch.cat([(torch.tensor([1.0, 0, 0, 1]) - 0.5) / (torch.tensor([1.0, 0, 0, 1]).std() + 1e-4),
                     torch.zeros(4)]).double()
    cfg = GRPOLossConfig(loss_agg=agg)
    b = collate(rows, pad_id=0, dtype=torch.float64)
    lp = completion_logprobs(model, b)
    loss, _ = grpo_loss(lp, b.behaviour_logprobs, adv, b.loss_mask,
                        batch_normalizer([r.trajectory.loss_mask for r in rows], cfg), cfg)
    loss.backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert ref.norm() > 0
    assert (got - ref).norm() / ref.norm() < 1e-6


def test_all_zero_advantage_step_still_steps_adamw(tiny):
    """Skipping every row leaves zero gradients (not None), so AdamW's moments still move the weights."""
    torch.manual_seed(0)
    model = load_model(tiny)
    tr = PolicyTrainer(model, TrainerConfig(lr=1e-2), pad_id=0)
    buf = GroupBuffer(1)
    fill(buf, "a", [1, 0, 0, 1])
    tr.train_step(buf.take(1))
    before = [p.detach().clone() for p in model.parameters()]
    fill(buf, "b", [0, 0, 0, 0])
    m = tr.train_step(buf.take(1))
    assert m["train/skipped_zero_adv_samples"] == 4 and m["train/grad_norm"] == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_take_prefers_groups_whose_rewards_differ_when_asked():
    buf = GroupBuffer(max_staleness=1)
    fill(buf, "flat0", [0, 0])
    fill(buf, "mixed", [1, 0])
    fill(buf, "flat1", [1, 1])
    fill(buf, "mixed2", [0.5, 0])
    assert [g.group_id for g in buf.take(2, prefer_informative=True)] == ["mixed", "mixed2"]
    assert [g.group_id for g in buf.take(1, prefer_informative=True)] == ["flat0"]  # then the oldest others
    buf2 = GroupBuffer(max_staleness=1)
    fill(buf2, "flat0", [0, 0])
    fill(buf2, "mixed", [1, 0])
    assert [g.group_id for g in buf2.take(1)] == ["flat0"]  # default: arrival order


def test_a_step_is_bounded_in_samples_whatever_the_groups():
    """``max_samples``: groups oldest first, passing over (and keeping for the next step) those that would take
    the step past the bound; the first group is always taken, and without a bound nothing changes."""
    buf = GroupBuffer(max_staleness=1)
    for gid, n in (("r1", 6), ("r2", 6), ("a", 2), ("r3", 6), ("b", 2), ("c", 2)):
        fill(buf, gid, [1] + [0] * (n - 1))
    assert buf.smallest_group == 2  # what the trainer's default bound is set from (twice batch_groups of it)
    step = buf.take(4, max_samples=16)
    assert [g.group_id for g in step] == ["r1", "r2", "a", "b"] and sum(g.size for g in step) == 16
    assert [g.group_id for g in buf.ready] == ["r3", "c"] and buf.counters["deferred_groups"] == 1
    assert [g.group_id for g in buf.take(4, max_samples=4)] == ["r3"]  # larger than the bound: alone
    assert [g.group_id for g in buf.take(4, max_samples=4)] == ["c"]
    free = GroupBuffer(max_staleness=1)
    for gid, n in (("r1", 6), ("r2", 6), ("r3", 6), ("a", 2)):
        fill(free, gid, [1] + [0] * (n - 1))
    assert sum(g.size for g in free.take(4)) == 20


def test_unsolved_groups_are_set_aside_for_their_resample():
    """``resample_unsolved: 6``: a complete group of 2 with no pass and equal rewards never trains (the
    scheduler sent a 6-sample group of its task in its place); solved, mixed, penalised-but-differing
    and 6-sample groups that found a pass do (an unsolved 6-sample one is dropped ``unsolved``), and nothing is
    set aside when the option is off."""
    buf = GroupBuffer(max_staleness=1, resample_unsolved=6)
    fill(buf, "zero", [0, 0])
    fill(buf, "neg", [-0.5, -0.5])  # equal rewards below the pass mark: unsolved too
    fill(buf, "solved", [1, 1])
    fill(buf, "mixed", [0, 0.5])
    fill(buf, "resample", [0, 1, 0, 0, 0, 0])  # a re-sample that found a pass trains
    fill(buf, "resample_unsolved", [0] * 6)  # one that did not is dropped: its advantages are all 0
    buf.add(scored("partial", 0, size=2, reward=0), ("s", 0), 9_999)
    assert [g.group_id for g in buf.ready] == ["solved", "mixed", "resample"]
    assert buf.counters["superseded_unsolved"] == 2 and {"zero", "neg"} <= buf.done_groups
    assert buf.counters["dropped_unsolved"] == 1 and "resample_unsolved" in buf.done_groups
    assert [(d.group_id, d.reason) for d in buf.take_drops()][-1] == ("resample_unsolved", "unsolved")
    fill(buf, "zero", [0, 0])  # a redelivery is skipped, not set aside again
    assert buf.counters["superseded_unsolved"] == 2 and buf.counters["duplicates_skipped"] == 2
    off = GroupBuffer(max_staleness=1)
    fill(off, "zero", [0, 0])
    fill(off, "big", [0] * 6)
    assert [g.group_id for g in off.ready] == ["zero", "big"] and not off.counters["superseded_unsolved"]
    assert not off.counters["dropped_unsolved"]


def test_every_group_left_untrained_is_reported_once_with_its_reason():
    """Failed, stale and superseded groups come out of ``take_drops`` (once, in order, with the oldest
    behaviour version and the samples held); trained groups and duplicates do not. Drops that could not
    be announced go back first. Their records are released for committing as soon as they drop."""
    buf = GroupBuffer(max_staleness=0, resample_unsolved=6)
    buf.add(scored("failed", 0, size=2, infra=True, version=2), ("s", 0), 0)
    fill(buf, "old", [1, 0], version=1)
    fill(buf, "fresh", [1, 0], version=3)
    fill(buf, "unsolved", [0, 0], version=3)
    assert buf.drop_stale(version=3) == 1
    drops = buf.take_drops()
    assert [(d.group_id, d.reason, d.behaviour_version, d.samples) for d in drops] == [
        ("failed", "failed", 2, 1), ("unsolved", "superseded_unsolved", 3, 2), ("old", "stale", 1, 2)]
    assert buf.take_drops() == [] and not buf.has_drops
    fill(buf, "old", [1, 0], version=1)  # a redelivery of a dropped group is skipped, not reported again
    buf.mark_trained(buf.take(1))
    assert buf.take_drops() == []
    buf.return_drops(drops[:1])
    assert buf.has_drops and [d.group_id for d in buf.take_drops()] == ["failed"]
    held = GroupBuffer(max_staleness=0)
    held.add(scored("f", 0, size=2, infra=True), ("p", 0), 0)  # dropped at once: offset 0 is free
    held.add(scored("partial", 0, size=2), ("p", 0), 1)
    assert held.commit_offsets() == {("p", 0): 1} and [d.group_id for d in held.take_drops()] == ["f"]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_trainer_scores_at_the_sampling_temperature(tiny, temperature):
    """On-policy, the trainer's log-probs equal the rollout engine's behaviour log-probs (ratio 1)."""
    from rollout_service.engine import GenerationRequest
    from rollout_service.torch_engine import TorchEngine
    from shared.model import load_tokenizer
    from shared.schemas import SamplingParams

    model = load_model(tiny)
    engine = TorchEngine(model, load_tokenizer(tiny), seed=0)
    prompt = [1, 2, 3, 4]
    (samples,) = engine.generate([GenerationRequest(prompt, 4, SamplingParams(max_new_tokens=6,
                                                                               temperature=temperature))])
    rows = []
    for i, s in enumerate(samples):
        r = scored("g", i, comp=s.completion_ids or (5,), lps=s.logprobs or None, prompt=prompt)
        r.trajectory.temperature = temperature
        rows.append(r)
    b = collate(rows, pad_id=0)
    with torch.no_grad():
        lp = completion_logprobs(model, b)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        torch.testing.assert_close(lp[i, :n], torch.tensor(s.logprobs), atol=2e-4, rtol=1e-4)


def test_a_state_saved_with_the_unfused_adamw_resumes_on_the_fused_kernel(tiny):
    """AdamW is torch's fused kernel; ``load_state_dict`` takes the saver's groups, so a state written before
    (``fused: None``) would turn it off for the rest of the run."""
    torch.manual_seed(0)
    tr = PolicyTrainer(load_model(tiny), TrainerConfig(), pad_id=0)
    assert tr.optimizer.param_groups[0]["fused"] is True
    state = tr.state_dict(set())
    for g in state["optimizer"]["param_groups"]:
        g["fused"] = None
    again = PolicyTrainer(load_model(tiny), TrainerConfig(), pad_id=0)
    again.load_state_dict(state)
    assert all(g["fused"] is True for g in again.optimizer.param_groups)


def _bucket_cost(lengths, buckets, pass_cost):
    fed = [max(max(lengths[i] for i in b) - 1, 0) for b in buckets]
    return sum(len(b) * f + (pass_cost if f else 0) for b, f in zip(buckets, fed))


@pytest.mark.parametrize("pass_cost", [0.0, 3.0, 12.0, math.inf])
def test_length_buckets_cover_every_row_once_at_the_least_cost(pass_cost):
    lengths = [24, 3, 2, 24, 9, 1, 0, 17, 3, 24]
    buckets = length_buckets(lengths, pass_cost)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    best = math.inf  # brute force over every split of the sorted rows into contiguous runs
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for cuts in itertools.product([0, 1], repeat=len(order) - 1):
        runs, cur = [], [order[0]]
        for c, i in zip(cuts, order[1:]):
            if c:
                runs.append(cur)
                cur = []
            cur.append(i)
        best = min(best, _bucket_cost(lengths, runs + [cur], pass_cost))
    assert _bucket_cost(lengths, buckets, pass_cost) == best
    if pass_cost == math.inf:
        assert len(buckets) == 1
    if pass_cost == 0.0:  # no padding at all: one pass per length that feeds tokens
        assert all(len({max(lengths[i] - 1, 0) for i in b}) == 1 for b in buckets if max(lengths[i] for i in b) > 1)
    assert length_buckets([], pass_cost) == []


def test_a_micro_batch_without_completion_tokens_gives_empty_logprobs(tiny):
    model = load_model(tiny)
    b = collate([scored("g", 0, comp=()), scored("g", 1, comp=())], pad_id=0)
    with torch.no_grad():
        lp = completion_logprobs(model, b)
    assert lp.shape == (2, 1) and not lp.any()
