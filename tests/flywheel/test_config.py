"""The root config and each service's own settings: same values, moved keys named, overrides that merge."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flywheel.config import FlywheelConfig, load_config
from rollout_service.config import RolloutSettings
from sandbox_service.config import SandboxSettings
from scheduler_service.config import SchedulerSettings
from trainer_service.config import TrainerSettings
from verifier_service.config import VerifierSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SETTINGS = (SchedulerSettings, RolloutSettings, VerifierSettings, TrainerSettings, SandboxSettings)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_service_reads_the_same_sections_as_the_root_config(path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_BUDGET__MAX_STEPS", "7")
    monkeypatch.setenv("FLYWHEEL_WEIGHTS__TRANSPORT", "distributed")
    root = load_config(path)
    assert isinstance(root, SETTINGS) and root.budget.max_steps == 7
    for cls in SETTINGS:
        own = cls.load(path)
        for name in cls.model_fields:
            assert getattr(own, name) == getattr(root, name), (cls.__name__, name)


@pytest.mark.parametrize("section, key, new", [
    ("trainer", "max_steps", "budget.max_steps"), ("trainer", "batch_groups", "budget.batch_groups"),
    ("trainer", "weight_transport", "weights.transport"), ("trainer", "clip_eps", "trainer.loss.clip_eps"),
    ("scheduler", "oversample", "budget.oversample"), ("scheduler", "resample_unsolved", "budget.resample_unsolved"),
])
def test_a_moved_key_is_refused_with_its_new_place_by_the_root_and_by_its_service(section, key, new, monkeypatch):
    with pytest.raises(ValidationError, match=f"{section}.{key} has moved to {new}"):
        load_config(**{section: {key: 1}})
    monkeypatch.setenv(f"FLYWHEEL_{section.upper()}__{key.upper()}", "1")
    service = TrainerSettings if section == "trainer" else SchedulerSettings
    with pytest.raises(ValidationError, match=f"{section}.{key} has moved to {new}"):
        service.load()


def test_a_loss_field_override_keeps_the_kind_the_file_names_in_short_form(monkeypatch):
    toy = ROOT / "examples/toy.yaml"  # loss: bnpo
    assert load_config(toy, trainer={"loss": {"clip_eps": 0.3}}).trainer.loss.model_dump() == {
        **load_config(toy).trainer.loss.model_dump(), "clip_eps": 0.3}
    monkeypatch.setenv("FLYWHEEL_TRAINER__LOSS__CLIP_EPS", "0.3")
    for cfg in (load_config(toy), TrainerSettings.load(toy)):
        assert (cfg.trainer.loss.kind, cfg.trainer.loss.clip_eps, cfg.trainer.loss.loss_agg) == ("bnpo", 0.3, "token_mean")
    assert TrainerSettings.load().trainer.loss.kind == "grpo"  # no loss in the file: the default kind


def test_a_field_and_its_sub_field_in_the_environment_are_refused(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__LOSS", "dapo")
    monkeypatch.setenv("FLYWHEEL_TRAINER__LOSS__CLIP_EPS", "0.3")  # would be dropped silently
    with pytest.raises(ValueError, match="FLYWHEEL_TRAINER__LOSS and FLYWHEEL_TRAINER__LOSS__CLIP_EPS"):
        load_config()


def test_a_service_ignores_other_sections_and_the_root_refuses_unknown_ones(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sandbox: {port: 9}\nbogus: {x: 1}\n")
    assert TrainerSettings.load(p).budget.max_steps == 30 and SandboxSettings.load(p).sandbox.port == 9
    with pytest.raises(ValidationError, match="bogus"):
        FlywheelConfig.load(p)
