"""The verifier's defaults are the safe ones for every task that names no recipe, however it came in: a task
body as REST validates it (``POST /v1/tasks``) without a recipe gets the truncation gate and hack zeroing; a task
opts out only with a recipe of its own that says why, and the shipped domains that opt out keep their reasons."""

from __future__ import annotations

import pytest

from flywheel.domains import get
from shared.schemas import TaskBody
from shared.verifier_specs import NO_TRUNCATION_GATE, Recipe
from verifier_service.config import VerifierConfig
from verifier_service.scorers import Scorer


def _rest_spec(verifier: dict, domain: str = "d"):
    """The verifier spec of a task as the scheduler's REST route validates it."""
    return TaskBody.model_validate({"domain": domain, "prompt": [{"role": "user", "content": "2+2?"}],
                                    "verifier": verifier}).verifier


@pytest.mark.parametrize("verifier,right", [
    ({"kind": "exact", "answer": "4", "extract": "last_number"}, "The answer is 4"),
    ({"kind": "regex", "pattern": "4"}, "4 and then some more"),
    ({"kind": "numeric", "answer": 4, "extract": "last_number"}, "so 4"),
])
async def test_a_rest_task_without_a_recipe_gives_no_credit_to_a_cut_off_answer(verifier, right):
    s = Scorer(VerifierConfig())
    spec = _rest_spec(verifier)
    assert spec.recipe is None
    whole = await s.score(spec, right, finish_reason="stop", domain="d")
    cut = await s.score(spec, right, finish_reason="length", domain="d")
    assert whole.total == 1.0, whole
    assert cut.total == 0.0 and cut.components["truncation"] == 0.0, cut  # right, but still going


async def test_a_rest_task_without_a_recipe_zeroes_a_hedged_answer():
    s = Scorer(VerifierConfig())
    r = await s.score(_rest_spec({"kind": "exact", "answer": "Paris", "extract": "answer_tag"}),
                      "<answer>Lyon</answer> or <answer>Paris</answer>", domain="d")
    assert r.total == 0.0 and "multiple_answers" in r.details["hacks"], r


async def test_an_opt_out_says_why_and_still_takes_the_domains_recipe():
    opt_out = {"reason": "no truncation gate: the budget is part of the task"}
    spec = _rest_spec({"kind": "regex", "pattern": "4", "recipe": opt_out})
    assert spec.recipe.opts_out
    plain = await Scorer(VerifierConfig()).score(spec, "4 and more", finish_reason="length", domain="d")
    assert plain.total == 1.0 and "truncation" not in plain.components, plain
    # the service's recipe for the domain still applies to an opted-out task (here: a format gate)
    cfg = VerifierConfig(recipes={"d": {"rules": [{"rule": "format", "answer_tag": True}], "gates": ["format"]}})
    gated = await Scorer(cfg).score(spec, "4 and more", finish_reason="length", domain="d")
    assert gated.total == 0.0 and gated.components["format"] == 0.0, gated
    # a task recipe that sets anything is the task's own, and wins
    own = _rest_spec({"kind": "regex", "pattern": "4", "recipe": {"hack_policy": "flag", "reason": "demo"}})
    assert not own.recipe.opts_out
    assert Scorer(cfg).recipe_for(own, "d") is own.recipe


def test_the_default_recipe_is_the_safe_one():
    r = VerifierConfig().default_recipe
    assert [x.rule for x in r.rules] == ["truncation"] and r.gates == ["truncation"] and r.hack_policy == "zero"


@pytest.mark.parametrize("domain", ["toy", "humaneval", "humaneval_repair", "geometry", "financial_extraction"])
def test_the_shipped_domains_that_opt_out_say_why(domain):
    recipe = Recipe.model_validate(get(domain).RECIPE)
    assert recipe.opts_out and recipe.reason.startswith(NO_TRUNCATION_GATE)


@pytest.mark.parametrize("domain", ["reasoning_gym", "gsm_symbolic"])
def test_the_shipped_answer_domains_gate_on_truncation(domain):
    recipe = Recipe.model_validate(get(domain).RECIPE)
    assert not recipe.opts_out and "truncation" in recipe.gates
