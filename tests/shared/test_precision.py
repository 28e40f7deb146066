"""Precision chosen for the machine: ``auto`` picks bf16 only where the device runs it natively, an explicit bf16
on a CPU that emulates it warns with the measured slowdown, and every torch service and the run state agree."""

from __future__ import annotations

import logging

import pytest

from shared import precision
from shared.precision import BF16Support, choose, probe_bf16, resolve

NATIVE = BF16Support(True, "CPU test with AVX512_BF16")
EMULATED = BF16Support(False, "CPU test without AVX512_BF16 or AMX (AVX2)")


@pytest.fixture
def forced(monkeypatch):
    """Set ``FLYWHEEL_NATIVE_BF16`` for one test, with the per-process probe cache cleared around it."""
    def force(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(precision.ENV, raising=False)
        else:
            monkeypatch.setenv(precision.ENV, value)
        probe_bf16.cache_clear()

    yield force
    probe_bf16.cache_clear()


@pytest.mark.parametrize("support, dtype", [(NATIVE, "bfloat16"), (EMULATED, "float32")])
def test_auto_follows_the_hardware(support, dtype):
    p = resolve("auto", support)
    assert p.dtype == dtype and p.requested == "auto" and p.native is support.native
    assert support.reason in p.reason and p.as_dict()["hardware"] == support.reason


@pytest.mark.parametrize("requested, bf16", [("bfloat16", True), (True, True), ("float32", False), (False, False)])
def test_explicit_choice_is_honoured_on_any_hardware(requested, bf16):
    for support in (NATIVE, EMULATED):
        assert resolve(requested, support).bf16 is bf16


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="float16"):
        resolve("float16", NATIVE)


def test_explicit_bf16_without_native_support_warns_with_the_measured_slowdown(caplog):
    caplog.set_level(logging.INFO, logger="precision")
    p = choose("rollout.dtype", "bfloat16", support=EMULATED, slowdown=lambda: 47.0)
    assert p.bf16
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "47x" in warnings[0] and "rollout.dtype" in warnings[0]


@pytest.mark.parametrize("requested, support", [("bfloat16", NATIVE), ("auto", EMULATED), ("auto", NATIVE),
                                                ("float32", EMULATED)])
def test_no_warning_where_bf16_is_native_or_not_used(caplog, requested, support):
    caplog.set_level(logging.INFO, logger="precision")

    def no_probe() -> float:
        raise AssertionError("the slowdown probe runs only for an emulated bf16")

    p = choose("trainer.autocast_bf16", requested, support=support, slowdown=no_probe)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"trainer.autocast_bf16 = {p.dtype}: {p.reason}"]


def test_the_probe_agrees_with_the_cpu_flags(forced):
    forced(None)
    flags = precision._cpu_flags()
    support = probe_bf16()
    assert support.native == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert precision.cpu_model() in support.reason


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_override_replaces_the_probe(forced, value):
    forced(value)
    support = probe_bf16()
    assert support.native is (value == "1") and precision.ENV in support.reason
    assert resolve("auto").bf16 is (value == "1")


def test_the_slowdown_probe_measures_a_ratio():
    ratio = precision.bf16_slowdown()
    assert 0 < ratio < 1000


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_trainer_resolves_auto_at_start(forced, tmp_path, value):
    from shared.model import build_tiny_model, load_model
    from trainer_service.config import TrainerConfig
    from trainer_service.trainer import PolicyTrainer

    forced(value)
    model_dir = build_tiny_model(tmp_path / "tiny")
    t = PolicyTrainer(load_model(model_dir), TrainerConfig(kl_coef=0.1, loss={"kind": "grpo", "off_policy": "decoupled"}),
                      pad_id=0)
    assert t.cfg.autocast_bf16 is (value == "1") and t.cfg.output_bf16 is (value == "1")
    assert {k: p.requested for k, p in t.precision.items()} == {"autocast_bf16": "auto", "output_bf16": "auto"}
    # the KL reference is a bf16 copy exactly when the body runs under bf16 autocast
    import torch

    ref_dtype = t.ref_model.model.layers[0].mlp.up_proj.weight.dtype
    assert ref_dtype == (torch.bfloat16 if value == "1" else torch.float32)


def test_auto_keeps_the_trainer_in_float32_when_its_loss_would_clip_bf16_rounding(forced, tmp_path):
    from shared.model import build_tiny_model, load_model
    from trainer_service.config import TrainerConfig
    from trainer_service.trainer import PolicyTrainer

    forced("1")
    model = load_model(build_tiny_model(tmp_path / "tiny"))
    t = PolicyTrainer(model, TrainerConfig(loss={"kind": "grpo", "off_policy": "ppo_clip"}), pad_id=0)
    assert t.cfg.autocast_bf16 is False and "ppo_clip" in t.precision["autocast_bf16"].reason
    explicit = PolicyTrainer(model, TrainerConfig(autocast_bf16=True, loss={"kind": "grpo", "off_policy": "ppo_clip"}),
                             pad_id=0)
    assert explicit.cfg.autocast_bf16 is True  # an explicit choice is honoured


def test_settings_default_to_auto_and_refuse_other_dtypes():
    from pydantic import ValidationError

    from rollout_service.config import RolloutConfig
    from trainer_service.config import TrainerConfig

    assert RolloutConfig().dtype == "auto"
    assert TrainerConfig().autocast_bf16 == "auto" and TrainerConfig().output_bf16 == "auto"
    assert TrainerConfig(autocast_bf16="true").autocast_bf16 is True
    with pytest.raises(ValidationError, match="dtype"):
        RolloutConfig(dtype="float16")
    with pytest.raises(ValidationError, match="output_bf16"):
        TrainerConfig(output_bf16="sometimes")


def test_the_run_state_records_what_the_services_choose(forced, tmp_path):
    from flywheel.service_env import precision_plan

    forced("0")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("rollout: {dtype: auto}\ntrainer: {autocast_bf16: true}\n")
    plan = precision_plan(cfg, {})
    assert {k: (p["requested"], p["dtype"]) for k, p in plan.items()} == {
        "rollout.dtype": ("auto", "float32"), "trainer.autocast_bf16": ("true", "bfloat16"),
        "trainer.output_bf16": ("auto", "float32")}
    # on a bf16 machine auto trains in bf16 only with the decoupled correction (the default loss clips instead)
    forced("1")
    plan = precision_plan(cfg, {})
    assert plan["rollout.dtype"]["dtype"] == "bfloat16" and plan["trainer.output_bf16"]["dtype"] == "float32"
    assert precision_plan(cfg, {"FLYWHEEL_TRAINER__LOSS__OFF_POLICY": "decoupled"})["trainer.output_bf16"]["dtype"] == \
        "bfloat16"
    forced("0")
    # the environment wins over the YAML; engines without a torch model choose nothing
    plan = precision_plan(cfg, {"FLYWHEEL_TRAINER__AUTOCAST_BF16": "false", "FLYWHEEL_ROLLOUT__ENGINE": "null"})
    assert "rollout.dtype" not in plan and plan["trainer.autocast_bf16"]["dtype"] == "float32"
    assert precision_plan(cfg, {"FLYWHEEL_TRAINER__NULL_STEP": "true", "FLYWHEEL_ROLLOUT__ENGINE": "null"}) == {}
