"""Each loss preset against TRL's ``GRPOTrainer`` loss (dev dependency ``trl==1.16.0``).

For every preset and β ∈ {0, 0.04} one optimizer batch (2 groups × 4 samples, completions of 2-9
tokens) trains through Flywheel's ``PolicyTrainer.train_step`` and through TRL 1.16's
``GRPOTrainer._compute_loss`` on a copy of the same float64 tiny Llama, with the ``GRPOConfig`` that
``trainer_service/losses/__init__.py`` names for the preset. The batch is off-policy: the behaviour
log-probs are the model's own plus noise (token presets: σ = 0.15, ratios 0.69-1.55, 20 % of the
tokens outside 1 ± 0.2; GSPO: sequence log-ratios spread over ±8e-4, 5 of 8 outside its 3e-4 / 4e-4), so
the importance weights of the surrogate and of the KL term are not 1. With β > 0 the reference is the
model with its weights scaled by 0.9, and the KL is k3 with TRL's ``use_bias_correction_kl`` (its
default). TRL computes its own log-probs (its fused LM head over the concatenated prompt and
completion); it is fed Flywheel's advantages (its advantage code runs inside generation), the
behaviour log-probs as ``old_per_token_logps`` and the reference's as ``ref_per_token_logps``.

The gradients over all parameters agree to a relative L2 ≤ 1e-5 (about 3e-7: TRL's fused LM head
computes log-probs in float32). The step is one micro-batch, where TRL's per-micro-batch normalisers
(``grpo``, ``bnpo``, ``dr_grpo``) equal Flywheel's whole-batch ones. GSPO with β > 0: see
:func:`relative_l2`. ``python3 -m tests.trainer_service.test_trl_parity`` prints the table, with the
gap of the unweighted KL term that Flywheel once had.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (a dependency of trl)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from shared.model import build_tiny_model, load_model  # noqa: E402
from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory  # noqa: E402
from trainer_service.config import TrainerConfig  # noqa: E402
from trainer_service.groups import GroupBuffer  # noqa: E402
from trainer_service import trainer as trainer_module  # noqa: E402
from trainer_service.trainer import PolicyTrainer  # noqa: E402

L_MAX = 12  # the generation budget: Dr. GRPO's constant, TRL's max_completion_length
TRL_ARGS = {  # preset: the GRPOConfig fields that make TRL compute the same objective
    "grpo": {"loss_type": "grpo", "epsilon": 0.2, "scale_rewards": "group"},
    "bnpo": {"loss_type": "bnpo", "epsilon": 0.2, "scale_rewards": "group"},
    "dr_grpo": {"loss_type": "dr_grpo", "epsilon": 0.2, "scale_rewards": "none"},
    "dapo": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group"},
    "rloo": {"loss_type": "dapo", "epsilon": 0.2},  # token mean over the batch; fed leave-one-out advantages
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
}
BETAS = (0.0, 0.04)
TASK = Task(task_id="t", domain="toy", prompt=[{"role": "user", "content": "q"}],
            verifier={"kind": "regex", "pattern": "^a"})
REWARDS = ([1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0, 0.2])
LENGTHS = ([3, 7, 2, 9], [5, 4, 8, 6])

pytestmark = pytest.mark.usefixtures("float32_numerics")  # compared with float32/64 references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _hf_logprobs(model, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """log π of each completion token by a plain full forward (prompts of equal length, no padding): ``[B, T]``."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompts, completions], 1)).logits
    P = prompts.shape[1]
    logp = logits[:, P - 1:-1].log_softmax(-1)
    return logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1)


def _batch(model, preset: str):
    """Prompt and completion ids ``[8, 3]`` / ``[8, 9]`` (0-padded), their mask, and off-policy behaviour log-probs."""
    gen = torch.Generator().manual_seed(1)
    lengths = [n for g in LENGTHS for n in g]
    T = max(lengths)
    prompts = torch.tensor([[1, 2, 3 + i % 2] for i in range(len(lengths))])
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    completions = (torch.randint(4, 100, (len(lengths), T), generator=gen) * mask).long()
    current = _hf_logprobs(model, prompts, completions)
    noise = torch.randn(current.shape, generator=gen, dtype=torch.float64)
    if preset == "gspo":  # sequence log-ratios u_i across the tiny clip range, zero-mean token noise around them
        u = torch.linspace(-8e-4, 8e-4, len(lengths), dtype=torch.float64)[torch.randperm(len(lengths), generator=gen)]
        noise = 0.05 * (noise - (noise * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
        behaviour = current - u[:, None] - noise
    else:
        behaviour = current - 0.15 * noise
    behaviour = (behaviour * mask).float().double()  # a Trajectory's log-probs arrive as float32
    return prompts, completions, mask, behaviour


def _groups(prompts, completions, mask, behaviour, rewards_per_group=REWARDS):
    buf = GroupBuffer(1)
    for g, rewards in enumerate(rewards_per_group):
        for k, r in enumerate(rewards):
            i = 4 * g + k
            n = int(mask[i].sum())
            tr = Trajectory(trajectory_id=f"g{g}:1:{k}", group_id=f"g{g}", sample_index=k, group_size=4, task=TASK,
                            prompt_ids=prompts[i].tolist(), completion_ids=completions[i, :n].tolist(),
                            completion_logprobs=behaviour[i, :n].tolist(), loss_mask=[1] * n, completion_text="x",
                            finish_reason="stop", policy_versions=[{"version": 0, "start": 0, "end": n}])
            buf.add(ScoredTrajectory(trajectory=tr, reward=Reward(total=r)), ("s", 0), i)
    return buf.take(2)


def _grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                      for p in model.parameters()])


def _flywheel(model, groups, preset: str, beta: float, weight_kl: bool = True):
    """Flywheel's gradient of the batch, its advantages ``[8]`` (rows in group order) and the reference model."""
    loss = {"kind": preset} if preset == "gspo" else {"kind": preset, "max_response_tokens": L_MAX}  # GSPO: no L_max
    cfg = TrainerConfig(loss=loss, kl_coef=beta, kl_estimator="k3", max_grad_norm=1e9, micro_batch_size=64)
    tr = PolicyTrainer(model, cfg, pad_id=0)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    if tr.ref_model is not None:
        tr.ref_model.load_state_dict(ref.state_dict())
    tr.optimizer.step = lambda: None  # keep the weights; read the gradient
    saved = trainer_module.kl_importance_weight
    if not weight_kl:  # the old unweighted KL term: samples treated as if drawn from π_θ
        trainer_module.kl_importance_weight = lambda logprobs, *args: torch.ones_like(logprobs)
    try:
        tr.train_step(groups)
    finally:
        trainer_module.kl_importance_weight = saved
    _, adv, _, _ = tr._advantages(groups)
    return _grad(model), adv.double(), ref


def _trl(model, prompts, completions, mask, behaviour, advantages, ref, preset: str, beta: float, out_dir):
    """TRL 1.16's gradient of the same batch: ``GRPOTrainer._compute_loss`` with the preset's GRPOConfig."""
    args = GRPOConfig(output_dir=str(out_dir), beta=beta, max_completion_length=L_MAX, num_generations=4,
                      per_device_train_batch_size=8, report_to=[], use_cpu=True, bf16=False, fp16=False,
                      **TRL_ARGS[preset])
    assert args.use_bias_correction_kl and args.temperature == 1.0 and args.delta is None
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "q"}] * 8))
    trainer.current_gradient_accumulation_steps = 1  # one optimizer step = this one batch
    inputs = {
        "prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
        "completion_mask": mask.long(), "advantages": advantages, "old_per_token_logps": behaviour,
        "ref_per_token_logps": _hf_logprobs(ref, prompts, completions) * mask,
        "num_items_in_batch": mask.sum(),
    }
    model.train()
    model.zero_grad(set_to_none=True)
    trainer._compute_loss(model, inputs).backward()
    return _grad(model)


def relative_l2(tiny, preset: str, beta: float, out_dir, weight_kl: bool = True, trl_gspo_kl: bool = False) -> float:
    """‖g_flywheel − g_TRL‖ / ‖g_TRL‖ for one preset and β.

    GSPO with β > 0: Flywheel weights the KL per token (``losses/kl.py``), so the reference is TRL's GSPO
    surrogate (β = 0) plus TRL's token-level KL term (``loss_type="grpo"``, the same per-sequence mean,
    with zero advantages so that only β·KL remains). ``trl_gspo_kl`` compares with TRL's own GSPO + β
    instead, which broadcasts the sequence ratio onto the KL.
    """
    torch.manual_seed(0)
    model = load_model(tiny).double()
    model_trl = copy.deepcopy(model)
    prompts, completions, mask, behaviour = _batch(model, preset)
    g_ours, adv, ref = _flywheel(model, _groups(prompts, completions, mask, behaviour), preset, beta, weight_kl)
    batch = (prompts, completions, mask, behaviour)
    if preset == "gspo" and beta > 0 and not trl_gspo_kl:
        g_trl = _trl(model_trl, *batch, adv, ref, "gspo", 0.0, out_dir) + _trl(
            copy.deepcopy(model_trl), *batch, torch.zeros_like(adv), ref, "grpo", beta, out_dir)
    else:
        g_trl = _trl(model_trl, *batch, adv, ref, preset, beta, out_dir)
    assert g_trl.norm() > 0 and not torch.isnan(g_trl).any()
    return float((g_ours - g_trl).norm() / g_trl.norm())


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("preset", list(TRL_ARGS))
def test_preset_gradient_equals_trl(tiny, tmp_path, preset, beta):
    assert relative_l2(tiny, preset, beta, tmp_path) <= 1e-5


def test_the_batch_is_off_policy_and_clips(tiny):
    """The comparison is not a trivial one: ratios ≠ 1, some tokens (GSPO: sequences) clipped, some not."""
    for preset, (lo, hi) in (("grpo", (0.8, 1.2)), ("gspo", (1 - 3e-4, 1 + 4e-4))):
        model = load_model(tiny).double()
        prompts, completions, mask, behaviour = _batch(model, preset)
        log_ratio = (_hf_logprobs(model, prompts, completions) - behaviour) * mask
        ratio = (log_ratio.sum(1) / mask.sum(1)).exp() if preset == "gspo" else log_ratio.exp()[mask > 0]
        outside = ((ratio < lo) | (ratio > hi)).float().mean()
        assert 0.1 < outside < 0.9, (preset, float(outside))


def kl_relative_l2(tiny, out_dir, weight_kl: bool = True) -> float:
    """The same for the KL part alone (``grpo``, β = 0.04): every reward equal, so every advantage is 0."""
    model = load_model(tiny).double()
    model_trl = copy.deepcopy(model)
    batch = _batch(model, "grpo")
    g_ours, adv, ref = _flywheel(model, _groups(*batch, ([1.0] * 4, [0.0] * 4)), "grpo", 0.04, weight_kl)
    assert torch.equal(adv, torch.zeros_like(adv))
    g_trl = _trl(model_trl, *batch, adv, ref, "grpo", 0.04, out_dir)
    return float((g_ours - g_trl).norm() / g_trl.norm())


def test_kl_without_the_importance_weight_misses_trl(tiny, tmp_path):
    """The old unweighted KL term differs from TRL's on this off-policy batch; weighted it agrees."""
    assert kl_relative_l2(tiny, tmp_path, weight_kl=False) > 1e-2  # 0.12 here
    # 7e-6 here: TRL's fused LM head computes log-probs in float32 (trl/kernels/chunked_logprob.py), and the KL
    # part alone is small, so its relative error is that of δ = log π_θ − log π_ref in float32
    assert kl_relative_l2(tiny, tmp_path) <= 5e-5


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_model(Path(d) / "tiny")
        print("| preset | TRL GRPOConfig | rel. L2, β = 0 | rel. L2, β = 0.04 |\n|---|---|---|---|")
        for name, trl_args in TRL_ARGS.items():
            cells = [f"{relative_l2(model_dir, name, b, Path(d) / 'out'):.1e}" for b in BETAS]
            print(f"| `{name}` | {', '.join(f'{k}={v!r}' for k, v in trl_args.items())} | {' | '.join(cells)} |")
        print(f"| `grpo`, KL without the weight (the old form) | | | "
              f"{relative_l2(model_dir, 'grpo', 0.04, Path(d) / 'out', weight_kl=False):.1e} |")
        print(f"| `grpo`, the KL part alone (all advantages 0): weighted / unweighted | | | "
              f"{kl_relative_l2(model_dir, Path(d) / 'out'):.1e} / "
              f"{kl_relative_l2(model_dir, Path(d) / 'out', weight_kl=False):.1e} |")
        print(f"| `gspo` against TRL's own GSPO + β (sequence ratio on the KL) | | | "
              f"{relative_l2(model_dir, 'gspo', 0.04, Path(d) / 'out', trl_gspo_kl=True):.1e} |")
