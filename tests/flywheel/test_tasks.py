"""The main job's task sources and the committed examples: which recipe their tasks carry. A cut-off
answer earns 0 by default (the verifier's safe default recipe); the arithmetic job and the toy domain opt
out in their YAML, with a reason, and keep crediting it, as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.config import load_config
from flywheel.tasks import TaskSourceConfig, make_tasks
from shared.schemas import Task
from verifier_service.config import VerifierConfig
from verifier_service.scorers import Scorer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _small(cfg: TaskSourceConfig) -> TaskSourceConfig:
    return cfg.model_copy(update={"train_size": 4, "eval_size": 2})


async def _cut_off_gold(cfg: TaskSourceConfig) -> list[float]:
    """Totals of every task's gold answer scored as a completion that hit the token budget."""
    scorer = Scorer(VerifierConfig())
    try:
        out = []
        for t in make_tasks(_small(cfg)):
            task = Task.model_validate(t)
            gold = task.verifier.entry["answer"] if task.verifier.kind == "reasoning_gym" else "abc"
            r = await scorer.score(task.verifier, str(gold), finish_reason="length", domain=task.domain)
            assert not r.infra_error, r
            out.append(r.total)
        return out
    finally:
        await scorer.close()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_loads(path):
    load_config(path)


async def test_a_cut_off_answer_earns_nothing_by_default():
    for kind in ("reasoning_gym", "toy_prefix"):
        cfg = TaskSourceConfig(kind=kind)
        assert cfg.recipe is None  # no recipe on the tasks: the verifier's safe default gates truncation
        assert set(await _cut_off_gold(cfg)) == {0.0}, kind


@pytest.mark.parametrize("name", ["arithmetic.yaml", "toy.yaml"])
async def test_the_arithmetic_job_and_the_toy_domain_keep_crediting_cut_off_answers(name):
    cfg = load_config(ROOT / "examples" / name).tasks
    assert cfg.recipe.opts_out and cfg.recipe.reason.startswith("no truncation gate")  # the YAML's opt-out
    assert cfg.recipe.gates == [] and cfg.recipe.rules == []  # nothing of a default merged under it
    assert all(t["verifier"]["recipe"]["reason"] == cfg.recipe.reason for t in make_tasks(_small(cfg)))
    assert set(await _cut_off_gold(cfg)) == {1.0}


def test_the_mixture_example_domains_carry_their_recipes():
    cfg = load_config(ROOT / "examples/mixture.yaml")
    small = cfg.tasks.model_copy(update={"domains": [d.model_copy(update={"train_size": 2, "eval_size": 1})
                                                     for d in cfg.tasks.domains]})
    recipes = {}
    for t in make_tasks(small):
        recipes.setdefault(t["domain"], Task.model_validate(t).verifier.recipe)
    assert recipes["reasoning_gym"].gates == ["format", "truncation"]  # from the domain's params
    assert recipes["gsm_symbolic"].gates == ["truncation"]  # the domain's default
    # they opt out of the truncation gate, with their reasons; verifier.recipes still applies to them
    assert recipes["financial_extraction"].opts_out and recipes["geometry"].opts_out
    assert set(cfg.verifier.recipes) == {"financial_extraction", "geometry"}


def test_a_bad_recipe_in_the_task_source_is_refused_at_load():
    with pytest.raises(ValueError, match="no rule or judge computes them"):
        TaskSourceConfig(recipe={"gates": ["format"]})
