"""A user's environment as a scheduler domain: its dataset rows become the domain's tasks, and an environment that
cannot be loaded is refused early (``PUT /v1/domains``, scheduler start, ``flywheel run``) naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from flywheel.cli.train import check_environment_domains
from flywheel.config import FlywheelConfig
from scheduler_service.config import DomainConfig, SchedulerConfig
from scheduler_service.issuing import TaskMaker
from shared import topics
from shared.config import BudgetConfig, KafkaConfig, RunConfig
from shared.schemas import RolloutRequest
from tests.scheduler_service.test_sampler import collect, wait_for

ENV = """
from flywheel.env import Environment

def load_environment(n=8):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "difficulty": i % 2} for i in range(n)]
    return Environment(dataset=rows, rubric=lambda completion, answer: float(answer in completion),
                       system_prompt="Answer with a number.")

def no_prompt():
    return Environment(dataset=[{"problem": "1 + 1", "answer": "2"}], rubric=lambda completion: 1.0)

def mapped():
    return Environment(dataset=[{"problem": "1 + 1", "answer": "2"}], rubric=lambda completion: 1.0,
                       columns={"question": "statement"})
"""


@pytest.fixture
def env_file(tmp_path) -> Path:
    path = tmp_path / "arith_env.py"
    path.write_text(ENV)
    return path


def _detail(r) -> list[tuple[list, str]]:
    return [(e["loc"], e["msg"]) for e in r.json()["detail"]]


async def test_an_environment_domain_makes_its_rows_into_tasks_level_by_level(make_config, running, env_file):
    """Held-out rows once, then ``tasks_per_level`` training rows at a time at the domain's level (rows by their
    difficulty column), each the task ``flywheel run`` makes of a row; the level runs dry once its rows are used."""
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.put("/v1/domains/arith", json={
            "environment": {"path": str(env_file), "args": {"n": 12}}, "eval_size": 2, "tasks_per_level": 3,
            "samples_per_task": 4, "levels": [{"difficulty": [0, 0]}, {"difficulty": [1, 1]}]})
        assert r.status_code == 200, r.text
        assert r.json()["config"]["generator"] is None and r.json()["status"] == "no_tasks"
        maker = TaskMaker(state.config, state.registry)
        made = await maker.run_needed({"arith"})
        assert sorted(t.split for t in made) == ["eval", "eval", "train", "train", "train"]
        assert all(t.difficulty == 0 for t in made if t.split == "train")
        got = (await client.get(f"/v1/tasks/{made[-1].task_id}")).json()
        assert (got["domain"], got["split"]) == ("arith", "train")  # registered as they are published
        task = made[-1].model_dump(mode="json")
        assert task["samples_per_task"] == 4
        assert task["prompt"][0] == {"role": "system", "content": "Answer with a number."}
        verifier = task["verifier"]
        assert verifier["kind"] == "environment" and verifier["environment"]["path"] == str(env_file)
        i = int(task["prompt"][1]["content"].split()[2])
        assert verifier["environment"]["args"] == {"n": 12} and verifier["answer"] == str(2 * i)
        assert verifier["row"] == {"difficulty": 0} and i % 2 == 0
        # level 0 has the even rows less the held-out ones: one more batch uses them up, then it is dry
        row = state.registry.domain("arith")
        second = await maker.run_needed({"arith"})
        assert 0 < len(second) <= 3 and not set(t.task_id for t in second) & set(t.task_id for t in made)
        assert await maker.run_needed({"arith"}) == [] and state.registry.domain("arith").batches["train:0"] == -1
        assert row.batches["eval:0"] == 1
        r = await client.patch("/v1/domains/arith", json={"level": 1})
        assert r.status_code == 200, r.text
        harder = await maker.run_needed({"arith"})
        assert harder and all(t.difficulty == 1 for t in harder)
        summary = (await client.get("/v1/domains/arith")).json()["tasks"]
        assert summary["eval"] == 2 and summary["train"] == len(made) - 2 + len(second) + len(harder)


@pytest.mark.parametrize("ref, says", [
    ({"path": "{dir}/missing_env.py"}, "missing_env.py' is not a file"),
    ({"path": "{env}:nope"}, "has no attribute 'nope'"),
    ({"module": "no_such_env_module"}, "'no_such_env_module' failed to import"),
])
async def test_an_environment_that_cannot_be_loaded_is_422_at_environment_and_changes_nothing(
        make_config, running, env_file, ref, says):
    ref = {k: v.format(dir=env_file.parent, env=env_file) for k, v in ref.items()}
    async with running(make_config(), kafka=False) as (client, state):
        assert (await client.put("/v1/domains/arith", json={"environment": {"path": str(env_file)}})).status_code == 200
        before = state.registry.domain("arith")
        for send in (client.put, client.patch):
            r = await send("/v1/domains/arith", json={"environment": ref})
            assert r.status_code == 422, r.text
            [(loc, msg)] = _detail(r)
            assert loc == ["body", "environment"] and says in msg
        assert state.registry.domain("arith") == before
        r = await client.put("/v1/domains/other", json={"environment": ref})
        assert r.status_code == 422 and state.registry.domain("other") is None


@pytest.mark.parametrize("function, says", [
    ("no_prompt", "has no 'prompt' or 'question' column; columns: ['answer', 'problem']"),
    ("mapped", "has no column 'statement' (mapped to 'question'); columns: ['answer', 'problem']"),
])
async def test_a_dataset_without_its_prompt_column_is_422_naming_the_column(
        make_config, running, env_file, function, says):
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.put("/v1/domains/arith", json={"environment": {"path": f"{env_file}:{function}"}})
        assert r.status_code == 422, r.text
        [(loc, msg)] = _detail(r)
        assert loc == ["body", "environment"] and says in msg and "arith_env.py" in msg
        assert state.registry.domain("arith") is None


@pytest.mark.parametrize("body, loc, says", [
    ({"generator": "tests.support.generators:make"}, ["body"], "mutually exclusive"),
    ({"params": {"digits": 2}}, ["body"], "environment.args"),
    ({"levels": [{"difficulty": [0, 0]}, {}]}, ["body"], "needs a difficulty range"),
    ({"levels": [{"difficulty": [0, 0]}, {"difficulty": [5, 9]}]}, ["body", "levels", 1, "difficulty"],
     "no training row"),
    ({"eval_size": 8}, ["body", "eval_size"], "the 8 held-out rows (eval_size) are all its rows"),
])
async def test_an_environment_domain_config_that_cannot_issue_is_422_naming_the_field(
        make_config, running, env_file, body, loc, says):
    async with running(make_config(), kafka=False) as (client, _):
        r = await client.put("/v1/domains/arith", json={"environment": {"path": str(env_file)}, **body})
        assert r.status_code == 422, r.text
        assert any(e_loc == loc and says in msg for e_loc, msg in _detail(r)), r.json()


async def test_a_patched_environment_replaces_the_old_reference_whole(make_config, running, env_file, tmp_path):
    other = tmp_path / "other_env.py"
    other.write_text(ENV)
    async with running(make_config(), kafka=False) as (client, state):
        await client.put("/v1/domains/arith", json={"environment": {"path": str(env_file), "args": {"n": 4}}})
        r = await client.patch("/v1/domains/arith", json={"environment": {"path": str(other)}, "weight": 2})
        assert r.status_code == 200, r.text
        assert state.registry.domain("arith").config.environment.model_dump(exclude_none=True) == {
            "path": str(other), "args": {}}
        r = await client.patch("/v1/domains/arith", json={"environment": None})
        assert r.status_code == 200 and r.json()["config"]["generator"] is None


def _config(tmp_path, domains: dict, kafka_cfg: KafkaConfig | None = None, unique: str = "x") -> FlywheelConfig:
    return FlywheelConfig(
        kafka=kafka_cfg or KafkaConfig(), run=RunConfig(dir=str(tmp_path)),
        scheduler=SchedulerConfig(poll_interval_s=0.05, consumer_group=f"sched-{unique}", weights_model=f"m-{unique}",
                                  eval_before_training=False),
        budget=BudgetConfig(batch_groups=2, max_staleness=0, max_steps=30), domains=domains)


async def test_a_configured_environment_that_cannot_be_loaded_stops_the_scheduler_at_start(
        tmp_path, running, env_file):
    cfg = _config(tmp_path, {"good": DomainConfig(environment={"path": str(env_file)}),
                             "bad": DomainConfig(environment={"path": f"{env_file}:no_prompt"})})
    with pytest.raises(ValueError, match=r"domains\.bad\.environment: .*has no 'prompt' or 'question' column"):
        async with running(cfg, kafka=False):
            pass


def test_flywheel_run_checks_the_configured_environments_before_anything_starts(tmp_path, env_file, capsys):
    check_environment_domains(_config(tmp_path, {"arith": DomainConfig(environment={"path": str(env_file)})}))
    for ref, says in (({"path": str(tmp_path / "gone.py")}, "gone.py' is not a file"),
                      ({"path": "envs/arith_env.py"}, "is relative")):
        with pytest.raises(typer.Exit) as e:
            check_environment_domains(_config(tmp_path, {"arith": DomainConfig(environment=ref)}))
        assert e.value.exit_code == 2
        out = capsys.readouterr().out.replace("\n", "")
        assert "domains.arith.environment" in out and says in out


@pytest.mark.kafka
async def test_a_configured_environment_domain_issues_its_rows_from_the_start(
        tmp_path, kafka_cfg, unique, running, kafka_io, env_file):
    _, reader = kafka_io
    name = f"env{unique}"
    cfg = _config(tmp_path, {name: DomainConfig(environment={"path": str(env_file)}, eval_size=2, tasks_per_level=3,
                                                pool=f"p{unique}")}, kafka_cfg, unique)
    pooled = await reader(topics.rollout_requests(f"p{unique}"))
    async with running(cfg) as (_, state):
        assert await wait_for(lambda: state.registry.task_summary().get(name, {}).get("train") == 3)
        assert state.registry.task_summary()[name]["eval"] == 2
        reqs = await collect(pooled, RolloutRequest, lambda r: r.task.domain == name, want=2)
        assert reqs and all(r.task.verifier.kind == "environment" for r in reqs)
