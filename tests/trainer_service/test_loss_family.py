"""The GRPO family (Dr. GRPO, DAPO, RLOO, GSPO), off-policy corrections, KL estimators, truncation,
LR warm-up and exact resume: hand-computed examples and invariances on small inputs."""

import math

import pytest
import torch

from shared.model import load_model
from shared.model_weights import snapshot_weights
from trainer_service.config import TrainerConfig
from trainer_service.groups import GroupBuffer
from trainer_service.losses import resolve_loss
from trainer_service.losses.advantages import group_advantages
from trainer_service.losses.config import GRPOLossConfig, GSPOLossConfig
from trainer_service.losses.grpo import batch_normalizer, grpo_loss
from trainer_service.losses.gspo import gspo_loss
from trainer_service.losses.kl import kl_importance_weight, kl_term, kl_value
from trainer_service.main import build_trainer
from trainer_service.trainer import PolicyTrainer

from .test_checkpoint_resume import _config
from .test_trainer import fill, scored, tiny  # noqa: F401 - fixture

LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "rloo", "gspo"]


# ---------------------------------------------------------------- advantages

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32/64 references


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_exact_zero_advantages(estimator):
    assert torch.equal(group_advantages(torch.ones(1, 4, dtype=torch.float64), estimator), torch.zeros(1, 4,
                                                                                                   dtype=torch.float64))


def test_near_constant_group_is_bounded_by_the_std_floor():
    r = torch.tensor([[0.35] * 7 + [0.35 + 1e-7]], dtype=torch.float64)
    a = group_advantages(r, "grpo", 1e-4)
    assert a.abs().max() < 1e-2  # without the floor: (1e-7 · 7/8) / 3.5e-8 ≈ 2.5


def test_advantage_estimators_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)  # mean 0.5, unbiased std 1/sqrt(3)
    torch.testing.assert_close(group_advantages(r, "dr_grpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5]],
                                                                            dtype=torch.float64))
    # leave-one-out: 1 − mean(0, 0, 1) = 2/3; 0 − mean(1, 0, 1) = −2/3
    torch.testing.assert_close(group_advantages(r, "rloo"), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]],
                                                                         dtype=torch.float64))
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(group_advantages(r, "grpo", 1e-4), torch.tensor([[0.5, -0.5, -0.5, 0.5]],
                                                                               dtype=torch.float64) / (s + 1e-4))


# ---------------------------------------------------------------- presets


def test_each_preset_means_what_trl_and_verl_mean_by_its_name():
    """``grpo`` averages each sequence's tokens first, then the sequences (TRL ``loss_type="grpo"``,
    DeepSeekMath eq. 3, verl ``seq-mean-token-mean``). Before, it averaged over all the batch's tokens,
    which is TRL's ``bnpo`` (and ``dapo`` with a symmetric clip): that preset is now ``bnpo``."""
    got = {n: (resolve_loss(TrainerConfig(loss=n)).estimator, resolve_loss(TrainerConfig(loss=n)).cfg.loss_agg,
               resolve_loss(TrainerConfig(loss=n)).cfg.clip_eps, resolve_loss(TrainerConfig(loss=n)).cfg.eps_high)
           for n in LOSSES}
    assert got == {
        "grpo": ("grpo", "seq_mean_token_mean", 0.2, 0.2), "bnpo": ("grpo", "token_mean", 0.2, 0.2),
        "dr_grpo": ("dr_grpo", "seq_mean_token_sum", 0.2, 0.2), "dapo": ("grpo", "token_mean", 0.2, 0.28),
        "rloo": ("rloo", "token_mean", 0.2, 0.2), "gspo": ("grpo", "seq_mean_token_mean", 3e-4, 4e-4)}
    assert resolve_loss(TrainerConfig(loss={"kind": "grpo", "loss_agg": "token_mean"})).cfg.loss_agg == "token_mean"


# ---------------------------------------------------------------- surrogates, hand-computed


def _one_token(log_ratio: float, adv: float):
    lp = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    return lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1)


def test_dapo_clip_higher_lets_a_positive_advantage_grow_past_1_plus_eps_low():
    # ratio 1.25, A = +1: symmetric clip (0.2) caps the objective at 1.2 (no gradient); clip-higher (0.28) does not
    for hi, loss_value, grad in ((None, -1.2, 0.0), (0.28, -1.25, -1.25)):
        lp, blp, adv, mask = _one_token(math.log(1.25), 1.0)
        cfg = GRPOLossConfig(clip_eps=0.2, clip_eps_high=hi, loss_agg="token_mean")
        loss, m = grpo_loss(lp, blp, adv, mask, 1.0, cfg)
        loss.backward()
        assert loss.item() == pytest.approx(loss_value)
        assert lp.grad.item() == pytest.approx(grad)
        assert m["loss/clip_frac_sum"] == (1.0 if hi is None else 0.0)


def test_dr_grpo_sums_tokens_over_a_constant():
    # two sequences of 1 and 3 tokens, ratio 1, A = +1 and −1, L_max = 4: loss = (−1·1 + 1·3) / (2 · 4)
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    cfg = GRPOLossConfig(loss_agg="seq_mean_token_sum", max_response_tokens=4)
    norm = batch_normalizer([[1], [1, 1, 1]], cfg)
    assert norm == 8.0
    loss, _ = grpo_loss(lp, torch.zeros(2, 3, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64),
                        mask, norm, cfg)
    assert loss.item() == pytest.approx(2 / 8)


def test_gspo_clips_the_sequence_ratio_as_a_whole():
    # token log-ratios 0.1 and 0.3: s = exp(0.2) = 1.2214 > 1 + 4e-4
    lr = torch.tensor([[0.1, 0.3]], dtype=torch.float64)
    cfg = resolve_loss(TrainerConfig(loss="gspo")).cfg
    assert (cfg.clip_eps, cfg.eps_high) == (3e-4, 4e-4)
    pos = lr.clone().requires_grad_(True)
    loss, m = gspo_loss(pos, torch.zeros_like(lr), torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), 1.0, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 4e-4))  # A > 0: clipped at 1 + ε_high, no gradient
    assert torch.equal(pos.grad, torch.zeros_like(lr)) and m["loss/clip_frac_sum"] == 2.0
    neg = lr.clone().requires_grad_(True)
    loss, _ = gspo_loss(neg, torch.zeros_like(lr), torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2), 1.0, cfg)
    loss.backward()
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(s)  # A < 0: the unclipped s·A is the min
    # d(−s·A)/d log π_t = −A · s / |o| for every token of the sequence
    torch.testing.assert_close(neg.grad, torch.full_like(lr, s / 2))


@pytest.mark.parametrize("mode", ["decoupled", "tis"])
def test_off_policy_corrections_truncate_the_importance_weight(mode):
    # π/π_behaviour = 3, cap 2, A = +1: weight 2, gradient −2 per token (decoupled: ratio to π_prox is 1)
    lp, blp, adv, mask = _one_token(math.log(3.0), 1.0)
    loss, m = grpo_loss(lp, blp, adv, mask, 1.0, GRPOLossConfig(off_policy=mode, is_cap=2.0, loss_agg="token_mean"))
    loss.backward()
    assert lp.grad.item() == pytest.approx(-2.0)
    assert m["loss/is_weight_sum"] == pytest.approx(2.0) and m["loss/is_truncated_sum"] == 1.0
    if mode == "decoupled":
        assert loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize("surrogate,cfg", [(grpo_loss, GRPOLossConfig(loss_agg="token_mean")),
                                           (gspo_loss, GSPOLossConfig(clip_eps=0.2, clip_eps_high=None)),
                                           (grpo_loss, GRPOLossConfig(off_policy="decoupled", loss_agg="token_mean")),
                                           (grpo_loss, GRPOLossConfig(loss_agg="seq_mean_token_mean"))])
def test_masked_middle_tokens_change_neither_loss_nor_gradient(surrogate, cfg):
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    blp = torch.tensor([[-1.0, -2.0, -3.0, -1.5]], dtype=torch.float64)
    out = []
    for middle in (0.0, 5.0):
        lp = torch.tensor([[-0.9, -1.0 + middle, -2.5 - middle, -1.4]], dtype=torch.float64, requires_grad=True)
        loss, _ = surrogate(lp, blp, torch.tensor([0.7], dtype=torch.float64), mask, 2.0, cfg)
        loss.backward()
        out.append((loss.item(), lp.grad[0, [0, 3]].clone(), lp.grad[0, 1:3].clone()))
    assert out[0][0] == pytest.approx(out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1])
    assert torch.equal(out[1][2], torch.zeros(2, dtype=torch.float64))


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_computed_and_all_give_the_reverse_kl_gradient():
    delta = 0.5  # log π − log π_ref
    expected = {"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) - 1 + 0.5}
    for est, value in expected.items():
        lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([[-delta]], dtype=torch.float64)
        assert kl_value(lp.detach(), ref, est).item() == pytest.approx(value)
        term = kl_term(lp, ref, est)
        assert term.item() == pytest.approx(value)  # the term reports the estimator's value...
        term.sum().backward()
        assert lp.grad.item() == pytest.approx(delta)  # ...and its gradient is δ · ∇log π for every estimator


def test_k3_used_naively_would_give_the_forward_kl_gradient():
    lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    kl_value(lp, torch.tensor([[-0.5]], dtype=torch.float64), "k3").sum().backward()
    assert lp.grad.item() == pytest.approx(1 - math.exp(-0.5))  # (1 − π_ref/π), not δ: why kl_term exists


# ---------------------------------------------------------------- KL under staleness


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_on_policy_the_kl_weight_is_exactly_one_and_changes_nothing(est):
    torch.manual_seed(0)
    base = torch.randn(3, 5, dtype=torch.float64) - 2.0
    ref = base + 0.3 * torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    weighted, plain = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    w = kl_importance_weight(weighted, weighted.detach(), mask)  # behaviour == current log-probs
    assert torch.equal(w, torch.ones_like(w))
    a, b = kl_term(weighted, ref, est, w), kl_term(plain, ref, est)
    assert torch.equal(a, b)
    (a * mask).sum().backward()
    (b * mask).sum().backward()
    assert torch.equal(weighted.grad, plain.grad)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_off_policy_kl_term_is_weighted_by_pi_over_pi_behaviour(est):
    # log π = 0, log π_b = log 0.5 (w = 2), log π_ref = −0.5 (δ = 0.5): value 2·k, gradient 2·δ = 1
    lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5]], dtype=torch.float64)
    w = kl_importance_weight(lp, torch.tensor([[math.log(0.5)]], dtype=torch.float64), torch.ones(1, 1))
    assert w.item() == pytest.approx(2.0) and not w.requires_grad
    term = kl_term(lp, ref, est, w)
    assert term.item() == pytest.approx(2.0 * kl_value(lp.detach(), ref, est).item())
    term.sum().backward()
    assert lp.grad.item() == pytest.approx(1.0)


def test_weighted_k3_gradient_equals_trls_undetached_ratio_times_k3():
    """TRL's k3 · exp(log π − log π_b), the ratio not detached, has our gradient w·δ·∇log π at every token."""
    torch.manual_seed(1)
    lp0, blp, ref = (torch.randn(4, 6, dtype=torch.float64) - 2.0 for _ in range(3))
    ours, trl = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    kl_term(ours, ref, "k3", kl_importance_weight(ours, blp, torch.ones(4, 6))).sum().backward()
    (kl_value(trl, ref, "k3") * torch.exp(trl - blp)).sum().backward()
    torch.testing.assert_close(ours.grad, trl.grad)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_weighted_kl_is_unbiased_under_the_behaviour_policy(est):
    """Exact expectation over a 6-token vocabulary sampled by π_b: the weighted term's mean value is the
    estimator's mean under π_θ (KL(π_θ ‖ π_ref) for k1 and k3) and its mean gradient is ∇KL(π_θ ‖ π_ref)
    for every estimator; unweighted, the gradient is off."""
    torch.manual_seed(2)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    behaviour = torch.log_softmax(theta.detach() + 0.7 * torch.randn(6, dtype=torch.float64), 0)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    p_b = behaviour.exp()

    def expected(weighted: bool) -> tuple[float, torch.Tensor]:
        theta.grad = None
        lp = torch.log_softmax(theta, 0)[None]  # every token of the vocabulary as one sample, [1, 6]
        w = kl_importance_weight(lp, behaviour[None], torch.ones(1, 6)) if weighted else None
        mean = (p_b * kl_term(lp, ref[None], est, w)[0]).sum()  # E_{y ~ π_b}[term(y)]
        mean.backward()
        return mean.item(), theta.grad.clone()

    lp = torch.log_softmax(theta, 0)
    kl = (lp.exp() * (lp - ref)).sum()
    kl.backward()
    true_grad = theta.grad.clone()
    value, grad = expected(weighted=True)
    on_policy_mean = (lp.exp() * kl_value(lp, ref, est)).sum().item()
    assert value == pytest.approx(on_policy_mean)
    if est != "k2":
        assert value == pytest.approx(kl.item())
    torch.testing.assert_close(grad, true_grad)
    _, unweighted = expected(weighted=False)
    assert (unweighted - true_grad).norm() > 0.05 * true_grad.norm()


# ---------------------------------------------------------------- through the trainer


def _groups():
    buf = GroupBuffer(1)
    fill(buf, "g1", [1, 0, 0, 1], comp=(10, 11, 12, 13))
    fill(buf, "g2", [0.5, 0.0, 1.0, 0.2], comp=(20, 21))
    return buf.take(2)


def _grads(tiny, micro, **cfg):
    torch.manual_seed(0)
    model = load_model(tiny).double()
    tr = PolicyTrainer(model, TrainerConfig(micro_batch_size=micro, max_grad_norm=1e9, lr=1e-3, **cfg), pad_id=0)
    if tr.ref_model is not None:  # a reference that differs from the policy, so the KL term is not 0
        with torch.no_grad():
            for p in tr.ref_model.parameters():
                p.mul_(0.9)
    tr.optimizer.step = lambda: None  # keep weights; inspect gradients
    m = tr.train_step(_groups())
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), m


@pytest.mark.parametrize("cfg", [{"loss": name} for name in LOSSES] + [
    {"loss": {"kind": "grpo", "off_policy": "decoupled"}}, {"loss": {"kind": "grpo", "off_policy": "tis"}},
    {"loss": "grpo", "kl_coef": 0.1, "kl_estimator": "k3"}, {"loss": "dr_grpo", "kl_coef": 0.1, "kl_estimator": "k1"}])
def test_every_loss_is_independent_of_the_micro_batch_split(tiny, cfg):
    (g8, m), (g4, _), (g2, _), (g1, _) = (_grads(tiny, mb, **cfg) for mb in (8, 4, 2, 1))
    assert g8.norm() > 0 and not torch.isnan(g8).any()
    for g in (g4, g2, g1):
        assert (g8 - g).norm() / g8.norm() < 1e-6
    if cfg.get("kl_coef"):
        assert m["loss/kl_ref_mean"] != 0.0


@pytest.mark.parametrize("loss", LOSSES)
def test_all_equal_rewards_give_no_nan_and_count_as_zero_variance(tiny, loss):
    model = load_model(tiny)
    tr = PolicyTrainer(model, TrainerConfig(loss=loss), pad_id=0)
    buf = GroupBuffer(1)
    fill(buf, "g", [1, 1, 1, 1])
    m = tr.train_step(buf.take(1))
    assert m["train/zero_variance_groups"] == 1.0 and m["train/grad_norm"] == 0.0
    assert all(not math.isnan(v) for v in m.values())
    assert all(not torch.isnan(p).any() for p in model.parameters())


@pytest.mark.parametrize("policy", ["mask", "penalise", "keep"])
def test_truncation_policy(tiny, policy):
    buf = GroupBuffer(1)
    for i, (r, fin) in enumerate([(1.0, "stop"), (0.0, "length"), (0.0, "stop"), (1.0, "stop")]):
        buf.add(scored("g", i, size=4, reward=r, finish=fin), ("s", 0), i)
    tr = PolicyTrainer(load_model(tiny), TrainerConfig(truncation=policy), pad_id=0)
    rows, adv, _, trains = tr._advantages(buf.take(1))
    assert trains == [True, policy != "mask", True, True]
    if policy == "penalise":  # rewards 1, −1, 0, 1: the cut sample is the group's worst
        assert adv[1] < adv[2] < 0
    else:
        assert adv[1] == adv[2]
    m = tr.train_step([_one_group(buf, policy)])
    assert m["train/truncated_masked"] == (1.0 if policy == "mask" else 0.0)
    assert m["train/samples"] == 4.0


def _one_group(buf, policy):
    buf = GroupBuffer(1)
    for i, (r, fin) in enumerate([(1.0, "stop"), (0.0, "length"), (0.0, "stop"), (1.0, "stop")]):
        buf.add(scored(f"h{policy}", i, size=4, reward=r, finish=fin), ("s", 0), i)
    return buf.take(1)[0]


def test_lr_warm_up_is_linear_then_constant(tiny):
    tr = PolicyTrainer(load_model(tiny), TrainerConfig(lr=1e-3, lr_warmup_steps=3), pad_id=0)
    lrs = []
    for k in range(5):
        buf = GroupBuffer(1)
        fill(buf, f"g{k}", [1, 0, 0, 1])
        lrs.append(tr.train_step(buf.take(1))["train/lr"])
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3])


def test_cosine_schedule_decays_to_its_floor_after_warm_up():
    from trainer_service.trainer import lr_factor
    cfg = TrainerConfig(lr_warmup_steps=2, lr_schedule="cosine", lr_min_ratio=0.1)
    factors = [lr_factor(cfg, 7, s) for s in range(8)]
    # warm-up 1/2, 1; then cosine over steps 2..6: t = 0, 1/4, 1/2, 3/4, 1; held at the floor after.
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)) for t in (0, 0.25, 0.5, 0.75, 1.0)]
    assert factors == pytest.approx([0.5, 1.0, *cos, 0.1])
    assert lr_factor(cfg.model_copy(update={"lr_schedule": "constant"}), 7, 6) == 1.0


def test_stale_samples_weight_the_kl_term_and_fresh_ones_do_not(tiny):
    """η = 1 with KL: rows whose behaviour log-probs are not π_θ's carry w ≠ 1 in the KL term; rows scored by
    π_θ itself (behaviour == the trainer's log-probs) carry w = 1 up to float32 storage of the log-probs."""
    from trainer_service.forward import collate, completion_logprobs
    model = load_model(tiny)
    buf = GroupBuffer(1)
    fill(buf, "stale", [1, 0, 0, 1], version=0)  # behaviour log-probs −1: not π_θ's
    tr = PolicyTrainer(model, TrainerConfig(kl_coef=0.05), pad_id=0)
    tr.optimizer.step = lambda: None
    tr.version = 1
    assert tr.train_step(buf.take(1))["loss/kl_ref_weight_mean"] != pytest.approx(1.0, abs=1e-2)
    rows = [scored("fresh", i, size=4, reward=float(i % 2)) for i in range(4)]
    with torch.no_grad():
        lp = completion_logprobs(model, collate(rows, pad_id=0))
    buf = GroupBuffer(1)
    for i, r in enumerate(rows):
        r.trajectory.completion_logprobs = lp[i, :len(r.trajectory.completion_ids)].tolist()
        buf.add(r, ("s", 0), i)
    assert tr.train_step(buf.take(1))["loss/kl_ref_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_staleness_eta_trains_with_its_importance_weight(tiny):
    """A sample at staleness η = 1 trains, its ratio π_θ/π_behaviour ≠ 1 weighting it; at η + 1 it is dropped."""
    buf = GroupBuffer(1)
    fill(buf, "old", [1, 0, 0, 1], version=1)
    fill(buf, "older", [1, 0, 1, 0], version=0)
    assert buf.drop_stale(2) == 1 and buf.counters["dropped_stale"] == 1
    tr = PolicyTrainer(load_model(tiny), TrainerConfig(), pad_id=0)
    tr.version = 2
    m = tr.train_step(buf.take(2))
    assert m["train/groups"] == 1.0 and m["train/staleness_hist/1"] == 4.0
    assert m["loss/ratio_mean"] != pytest.approx(1.0)  # the recorded behaviour log-probs (−1) differ from π_θ


# ---------------------------------------------------------------- exact resume


def _train(trainer, store, gids, done):
    for gid in gids:
        buf = GroupBuffer(1)
        fill(buf, gid, [1, 0, 0.5, 1], comp=(10 + len(gid), 11, 12))
        trainer.train_step(buf.take(1))
        done.add(gid)
        store.save(snapshot_weights(trainer.model), "m", trainer.version, trainer.step, trainer.state_dict(done),
                   trained_groups=[gid])


def test_six_steps_equal_three_then_resume_then_three(tmp_path):
    gids = [f"g{k}" for k in range(6)]
    straight_cfg = _config(tmp_path / "a")
    straight, store, done = build_trainer(straight_cfg.model_copy(
        update={"trainer": straight_cfg.trainer.model_copy(update={"lr_warmup_steps": 4})}))
    _train(straight, store, gids, done)

    cfg = _config(tmp_path / "b")
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"lr_warmup_steps": 4})})
    first, store_b, done_b = build_trainer(cfg)
    _train(first, store_b, gids[:3], done_b)
    del first  # the process is gone; only the checkpoint store remains
    resumed, store_b, done_b = build_trainer(cfg)
    assert resumed.version == 3 and done_b == set(gids[:3])
    _train(resumed, store_b, gids[3:], done_b)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
