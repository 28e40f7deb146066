"""Flywheel's own reasoning-gym domain through the public environment API (``environments/reasoning_gym``).

The environment and the built-in ``reasoning_gym`` verifier kind make the same tasks from the same seed, and the
verifier gives them the same reward: each kind is scored by the verifier's own path for it (``Scorer.score``;
the environment's rubric in its reward worker process, loaded by reference as the service loads it), on the
gold answer, a wrong answer, and answers with reasoning around them. The rules the package restates (answer
extraction, the generators scored another way) are checked against the verifier's own.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import numpy as np
import orjson
import pytest

from flywheel.config import load_config
from flywheel.tasks import TaskSourceConfig, make_tasks
from shared.envs import EnvironmentRef, load_environment
from shared.schemas import ReasoningGymSpec, Task
from shared.verifier_specs import EnvironmentSpec
from verifier_service import deterministic as det
from verifier_service.config import VerifierConfig
from verifier_service.extract import extract_answer, strip_reasoning
from verifier_service.main import environment_metrics
from verifier_service.scorers import Scorer

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "environments" / "reasoning_gym"
ENV_FILE = PACKAGE / "flywheel_env_reasoning_gym.py"
EXAMPLE = ROOT / "examples" / "reasoning_gym_env.yaml"
NO_GATE = {"reason": "no truncation gate: these tests compare the two kinds' scoring alone"}


def _module():
    """The environment's module, imported from its file (the tests need no installed package)."""
    spec = importlib.util.spec_from_file_location("flywheel_env_reasoning_gym_under_test", ENV_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RG = _module()

CONFIGS = {  # generators quick to make, numeric and not, one whose scorer raises on a malformed answer
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                         "operators": ["+", "-"], "allow_negation": False, "allow_parentheses": False},
    "chain_sum": {},
    "prime_factorization": {},
    "spell_backward": {},
}
NUMERIC = ("basic_arithmetic", "chain_sum")


def _both(dataset: str, extract: str, train: int = 4, held: int = 2, seed: int = 11) -> list[tuple[Task, Task]]:
    """``(built-in task, environment task)`` pairs with the same question: the built-in tasks made by the driver's
    reasoning_gym maker, the environment's by its environment maker (loaded from the file by reference)."""
    common = {"train_size": train, "eval_size": held, "seed": seed, "recipe": NO_GATE}
    builtin = make_tasks(TaskSourceConfig(kind="reasoning_gym", dataset=dataset, dataset_config=CONFIGS[dataset],
                                          extract=extract, **common))
    args = {"dataset": dataset, "size": train, "eval_size": held, "seed": seed, "config": CONFIGS[dataset],
            "extract": extract}
    env = make_tasks(TaskSourceConfig(kind="environment", environment={"path": str(ENV_FILE), "args": args},
                                      **common))
    question = {t["prompt"][-1]["content"]: Task(**t) for t in env}
    assert sorted((t["split"], t["prompt"][-1]["content"]) for t in builtin) == \
        sorted((t.split, q) for q, t in question.items())  # the same tasks, held-out and training alike
    return [(Task(**t), question[t["prompt"][-1]["content"]]) for t in builtin]


def _completions(gold: str, wrong: str, extract: str) -> dict[str, tuple[str, float]]:
    """Named completions and the reward each should get."""
    if extract == "last_number":
        return {"gold": (f"The answer is {gold}.", 1.0), "corrupt": (f"The answer is {wrong}.", 0.0),
                "reasoning": (f"<think>Maybe {wrong}? Check again.</think>Adding the terms one at a time, the "
                              f"result is {gold}", 1.0)}
    return {"gold": (f"<answer>{gold}</answer>", 1.0), "corrupt": (f"<answer>{wrong}</answer>", 0.0),
            "reasoning": (f"Let me work through it step by step, then check the result once more.\n"
                          f"<answer>{gold}</answer>\nThat is my final answer.", 1.0),
            "think_decoy": (f"<think>A first guess: <answer>{wrong}</answer>. No, check again.</think>\n"
                            f"The final answer is <answer>{gold}</answer>.", 1.0),
            "only_in_think": (f"<think><answer>{gold}</answer></think> I am not sure.", 0.0)}


def _wrong(gold: str, others: list[str], numeric: bool) -> str:
    """Another task's answer (what ``flywheel.domains.reasoning_gym.corrupt`` submits), or gold + 1."""
    if numeric:
        return str(int(gold) + 1)
    return next((a for a in others if a != gold), gold + " zq")


@pytest.fixture
async def scorer():
    s = Scorer(VerifierConfig(reward_workers=1, reward_timeout_s=60.0))
    try:
        yield s
    finally:
        await s.close()


@pytest.mark.parametrize("dataset, extract", [(d, "answer_tag") for d in CONFIGS] +
                         [(d, "last_number") for d in NUMERIC])
async def test_the_environment_rewards_what_the_built_in_kind_rewards(scorer, dataset, extract):
    pairs = _both(dataset, extract)
    answers = [b.verifier.entry["answer"] for b, _ in pairs]
    for builtin, env in pairs:
        assert isinstance(builtin.verifier, ReasoningGymSpec) and isinstance(env.verifier, EnvironmentSpec)
        gold = builtin.verifier.entry["answer"]
        assert env.verifier.answer == gold
        assert env.verifier.info["metadata"] == orjson.loads(orjson.dumps(builtin.verifier.entry["metadata"]))
        for name, (text, want) in _completions(gold, _wrong(gold, answers, dataset in NUMERIC), extract).items():
            got = {}
            for kind, task in (("builtin", builtin), ("environment", env)):
                got[kind] = await scorer.score(task.verifier, text, prompt=[m.model_dump() for m in task.prompt],
                                               domain=task.domain)
                assert not got[kind].infra_error, (kind, name, got[kind].details)
            assert got["environment"].total == got["builtin"].total == want, (dataset, name, text, got)
            raw = environment_metrics(got["environment"].details)["correct.raw_score"]
            assert raw == pytest.approx(got["builtin"].details.get("raw_score", 0.0)), (dataset, name, got)


def test_the_restated_extraction_reads_what_the_verifier_reads():
    texts = ["the answer is 1,234.", "5 - 3 = 2", "so it is -17", "10-3", "no digits here", "x = 3.25 m",
             "<answer>4</answer> wait <answer> 5 </answer>", "<answer>4", "< Answer >7</ANSWER >",
             "<answer><answer>8</answer>", "\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\boxed{oops", "  full \n",
             "   ", "<think>3 <answer>4</answer></think> 9 <answer>10</answer>", "<think>never closed 4",
             "1 <think>a</think> 2 </think> 3 <think> 4", "\\boxed{\\boxed{2}} \\boxed{3"]
    for how in ("last_number", "answer_tag", "boxed", "full"):
        for text in texts:
            assert RG.extract_answer(text, how) == extract_answer(strip_reasoning(text), how), (how, text)


def test_the_restated_tables_and_prompt_are_the_verifier_and_domain_ones():
    from flywheel.domains.common import ANSWER_TAG_SYSTEM

    assert RG.LENIENT_SCORERS == set(det.LENIENT_SCORERS)
    assert RG.TUPLE_METADATA_SCORERS == det.TUPLE_METADATA_SCORERS
    assert RG.ANSWER_TAG_SYSTEM == ANSWER_TAG_SYSTEM


def test_rows_are_plain_json_and_numpy_metadata_stays_numeric():
    assert RG.jsonable({"a": np.int64(3), "b": np.float32(0.5), "c": np.array([[1, 2]]), "d": (np.bool_(True),),
                        "e": {2, 1}, "f": float("nan")}) == {"a": 3, "b": 0.5, "c": [[1, 2]], "d": [True],
                                                             "e": [1, 2], "f": "nan"}
    env = load_environment({"path": str(ENV_FILE), "args": {"dataset": "chain_sum", "size": 5, "eval_size": 3}})
    for rows in (env.dataset, env.eval_dataset):
        assert orjson.loads(orjson.dumps(rows)) == rows
    held = {r["question"] for r in env.eval_dataset}
    assert len(env.dataset) == 5 and len(held) == 3 and not held & {r["question"] for r in env.dataset}


def test_a_bad_argument_is_refused_with_what_is_known():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'no_such'"):
        RG.load_environment("no_such")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['max_digitz'\].*'max_digits'"):
        RG.load_environment("basic_arithmetic", size=2, config={"max_digitz": 2})
    with pytest.raises(ValueError, match=r"only \d+ distinct questions for 500 asked"):
        RG.load_environment("basic_arithmetic", size=500, config=CONFIGS["basic_arithmetic"] | {"operators": ["+"]})


def test_the_package_declares_its_entry_point_and_loads_by_id_when_installed():
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["flywheel.environments"] == {
        "reasoning-gym": "flywheel_env_reasoning_gym:load_environment"}
    assert project["tool"]["setuptools"]["py-modules"] == [ENV_FILE.stem]
    if not any(e.name == "reasoning-gym" for e in importlib.metadata.entry_points(group="flywheel.environments")):
        pytest.skip("environments/reasoning_gym is not installed (scripts/install.sh installs it)")
    env = load_environment({"id": "reasoning-gym", "args": {"dataset": "chain_sum", "size": 3}})
    assert env.name == "chain_sum" and len(env.dataset) == 3


def test_the_example_config_makes_the_main_jobs_tasks(monkeypatch):
    """``examples/reasoning_gym_env.yaml`` makes the questions, system prompt and K of ``examples/arithmetic.yaml``
    (its reference read from the file, so that the test needs no installed package)."""
    import os

    for k in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(k)  # the files alone, as tests/flywheel/test_config.py reads them
    ours, main = load_config(EXAMPLE).tasks, load_config(ROOT / "examples" / "arithmetic.yaml").tasks
    assert ours.environment.id == "reasoning-gym"
    ours = ours.model_copy(update={"environment": EnvironmentRef(path=str(ENV_FILE), args=ours.environment.args)})

    def shape(tasks: list[dict]) -> list[tuple]:
        return sorted((t["split"], orjson.dumps(t["prompt"]), t["samples_per_task"]) for t in tasks)

    assert shape(make_tasks(ours)) == shape(make_tasks(main))
