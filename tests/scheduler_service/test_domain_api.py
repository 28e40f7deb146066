"""``/v1/domains`` over REST, and domains in a running sampler: pools, generated tasks, promotion."""

from __future__ import annotations

import pytest

from flywheel.config import FlywheelConfig
from scheduler_service.config import DomainConfig, SchedulerConfig
from shared import topics
from shared.config import BudgetConfig, KafkaConfig, RunConfig
from shared.schemas import RolloutRequest, WeightUpdate
from tests.scheduler_service.test_sampler import _produce, _reward, collect, wait_for

GEN = "tests.support.generators:make"


async def test_domains_are_read_created_and_patched_over_rest(make_config, running, task):
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", json={"tasks": [task("a", domain="math"), task("b", domain="code")]})
        assert r.status_code == 202
        listed = (await client.get("/v1/domains")).json()
        assert [d["domain"] for d in listed] == ["code", "math"]
        assert listed[1]["config"]["weight"] == 1.0 and listed[1]["tasks"]["train"] == 1
        r = await client.patch("/v1/domains/math", json={"weight": 2.5, "budget": {"samples": 100}})
        assert r.status_code == 200, r.text
        assert r.json()["config"]["weight"] == 2.5 and r.json()["budget_left"] == {"samples": 100.0}
        r = await client.patch("/v1/domains/math", json={"budget": {"judge_calls": 5}})  # nested sections merge
        assert r.json()["config"]["budget"] == {"samples": 100, "generated_tokens": None, "tool_rounds": None,
                                                "sandbox_seconds": None, "judge_calls": 5}
        r = await client.put("/v1/domains/new.domain", json={"weight": 0.5, "pool": "long", "max_tokens": 512})
        assert r.status_code == 200 and r.json()["status"] == "no_tasks"
        assert state.registry.domain("new.domain").config.pool == "long"
        r = await client.post("/v1/domains/math/pause")
        assert r.json()["status"] == "paused"
        st = (await client.get("/v1/status")).json()
        assert st["paused_domains"] == {"math": "state paused"} and st["domains"]["paused"] == 1
        assert (await client.post("/v1/domains/math/resume")).status_code == 200
        detail = (await client.get("/v1/domains/math")).json()
        assert detail["status"] == "active" and [e["kind"] for e in detail["events"]] == ["resumed"]


@pytest.mark.parametrize("body, loc", [
    ({"weight": -1}, ["body", "weight"]),
    ({"levels": []}, ["body", "levels"]),
    ({"level": 3}, ["body"]),
    ({"curriculum": {"mode": "adaptive"}}, ["body"]),
    ({"wieght": 2}, ["body", "wieght"]),
    ({"pool": "Bad Pool"}, ["body", "pool"]),
    ({"generator": GEN, "levels": [{"params": {"digits": 1}}, {"params": {"fail": True}}]},
     ["body", "levels", 1, "params"]),
    ({"generator": GEN, "levels": [{"params": {"no_such_knob": 1}}]}, ["body", "levels", 0, "params"]),
    ({"generator": "no.such.module"}, ["body", "generator"]),
])
async def test_bad_domain_changes_are_422_naming_the_field_and_change_nothing(make_config, running, task, body, loc):
    async with running(make_config(), kafka=False) as (client, state):
        await client.post("/v1/tasks", json={"tasks": [task("a", domain="math")]})
        before = state.registry.domain("math")
        r = await client.patch("/v1/domains/math", json=body)
        assert r.status_code == 422, r.text
        assert any(e["loc"][:len(loc)] == loc for e in r.json()["detail"]), r.json()
        assert state.registry.domain("math") == before


async def test_unknown_domain_is_404_and_a_bad_name_422(make_config, running):
    async with running(make_config(), kafka=False) as (client, _):
        assert (await client.patch("/v1/domains/nope", json={"weight": 1})).status_code == 404
        assert (await client.get("/v1/domains/nope")).status_code == 404
        assert (await client.post("/v1/domains/nope/pause")).status_code == 404
        assert (await client.put("/v1/domains/bad%20name", json={})).status_code == 422


async def test_duplicates_are_reported_at_submission(make_config, running, task):
    async with running(make_config(), kafka=False) as (client, _):
        same = {"prompt": [{"role": "user", "content": "Say  A"}]}
        r = await client.post("/v1/tasks", json={"tasks": [task("x", **same), task("y", prompt=[
            {"role": "user", "content": "say a "}])]})
        assert r.json() == {"task_ids": ["x", "y"], "duplicates": [{"task_id": "y", "duplicate_of": "x"}]}
        assert (await client.get("/v1/tasks/y")).json()["duplicate_of"] == "x"
        assert (await client.get("/v1/domains/toy")).json()["duplicate_tasks"] == ["y"]


def _config(tmp_path, kafka_cfg, unique, domains: dict) -> FlywheelConfig:
    return FlywheelConfig(
        kafka=kafka_cfg or KafkaConfig(), run=RunConfig(dir=str(tmp_path)),
        scheduler=SchedulerConfig(poll_interval_s=0.05, consumer_group=f"sched-{unique}", weights_model=f"m-{unique}",
                                  eval_before_training=False),
        budget=BudgetConfig(batch_groups=2, max_staleness=0, max_steps=30), domains=domains)


@pytest.mark.kafka
async def test_generator_domains_start_with_tasks_pools_route_and_promotion_makes_harder_ones(
        tmp_path, kafka_cfg, unique, running, kafka_io):
    producer, reader = kafka_io
    gen = f"gen{unique}"
    cfg = _config(tmp_path, kafka_cfg, unique, {gen: DomainConfig(
        generator=GEN, tasks_per_level=3, eval_size=2, pool=f"p{unique}", max_tokens=77,
        levels=[{"params": {"digits": 1}}, {"params": {"digits": 4}}],
        curriculum={"mode": "adaptive", "window": 2, "min_samples": 4, "promote_above": 0.9})})
    pool_topic = topics.rollout_requests(f"p{unique}")
    default = await reader(topics.ROLLOUT_REQUESTS)
    async with running(cfg) as (client, state):
        # the held-out tasks are registered first, then the level's training tasks: wait for both
        counts = await wait_for(lambda: (c := state.registry.task_summary().get(gen)) and c["train"] and c)
        assert (counts["train"], counts["eval"]) == (3, 2)
        pooled = await reader(pool_topic)
        reqs = await collect(pooled, RolloutRequest, lambda r: r.task.domain == gen, want=2)
        assert len(reqs) == 2 and all(r.sampling.max_new_tokens == 77 for r in reqs)
        assert await collect(default, RolloutRequest, lambda r: r.task.domain == gen, want=1, timeout_s=1.0) == []
        for r in reqs:  # every sample passes: promoted to level 1 after 4 of them
            for i in range(r.n):
                await _produce(producer, topics.REWARDS, _reward(r, i, True), r.task.task_id)
        assert await wait_for(lambda: state.registry.domain(gen).config.level == 1)
        assert await wait_for(lambda: state.registry.task_summary()[gen]["live_by_level"].get(1) == 3)
        wu = WeightUpdate(model=f"m-{unique}", version=1, step=1, manifest=[], checksum="sha256:x", path="/x")
        await _produce(producer, topics.WEIGHTS, wu, wu.model)  # room for the next groups
        harder = await collect(pooled, RolloutRequest, lambda r: r.task.domain == gen and ".L1." in r.task.task_id,
                               want=1, timeout_s=20)
        assert harder and " 4 " in harder[0].task.prompt[0].content
        dom = (await client.get(f"/v1/domains/{gen}")).json()
        assert dom["level"] == 1 and dom["spend"]["train"]["samples"] == 4
        assert {"promoted", "generated"} <= {e["kind"] for e in dom["events"]}
