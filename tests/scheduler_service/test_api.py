"""REST contract of the scheduler (no broker: ``kafka=False``)."""

from __future__ import annotations

import pytest

from shared.schemas import Task
from scheduler_service.models import TaskCreate
from scheduler_service.registry import Registry


def _fields(resp) -> list[str]:
    return [".".join(map(str, e["loc"])) for e in resp.json()["detail"]]


@pytest.mark.parametrize(
    "override, field",
    [
        ({"verifier": {"kind": "telepathy", "answer": "1"}}, "tasks.0.verifier"),
        ({"prompt": []}, "tasks.0.prompt"),
        ({"samples_per_task": 1}, "tasks.0.samples_per_task"),
        ({"domain": None}, "tasks.0.domain"),
    ],
)
async def test_malformed_task_is_422_naming_the_field_and_stores_nothing(
    make_config, running, task, unique, override, field
):
    bad = task(f"bad-{unique}", **override)
    if bad["domain"] is None:
        del bad["domain"]  # missing field
    good = task(f"good-{unique}")
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", json={"tasks": [good, bad]})
        assert r.status_code == 422
        assert any(f.endswith(field.replace("tasks.0", "tasks.1")) for f in _fields(r)), r.json()
        assert state.registry.get_task(f"good-{unique}") is None
        assert state.registry.task_counts() == {"train": 0, "eval": 0}
        assert (await client.get(f"/v1/tasks/good-{unique}")).status_code == 404


async def test_lone_surrogate_is_422_naming_the_field(make_config, running, task, unique):
    """``"\\ud800"`` is valid JSON but not UTF-8 text: a 4xx naming where it is, not a 500 from the store."""
    import json

    bad = task(f"bad-{unique}")
    bad["prompt"][-1]["content"] = "what is \ud800?"
    body = json.dumps({"tasks": [task(f"good-{unique}"), bad]})  # ensure_ascii: the escape reaches the server
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert "prompt.0.content" in r.json()["detail"][0]["msg"] and _fields(r)[0].endswith("tasks.1")
        assert state.registry.task_counts() == {"train": 0, "eval": 0}


@pytest.mark.parametrize("raw, field", [
    ('"metadata": {"a": 18446744073709551616}', "64 bits"),  # orjson cannot store it
    ('"metadata": {"a": NaN, "b": Infinity}', "finite"),  # would silently become null
    ('"metadata": {"\\ud800": 1}', "\\ud800"),  # a lone surrogate in a key, named escaped
    ('"task_id": ".."', "task id"),  # not addressable as a URL segment
])
async def test_unstorable_json_is_422_and_stores_nothing(make_config, running, task, unique, raw, field):
    import json

    good = json.dumps(task(f"good-{unique}"))
    bad = json.dumps(task(None if "task_id" in raw else f"bad-{unique}"))[:-1] + ", " + raw + "}"
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", content=f'{{"tasks": [{good}, {bad}]}}',
                              headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert field in r.json()["detail"][0]["msg"], r.json()
        assert state.registry.task_counts() == {"train": 0, "eval": 0}


async def test_task_ids_with_a_slash_can_be_read_back(make_config, running, task):
    async with running(make_config(), kafka=False) as (client, _):
        r = await client.post("/v1/tasks", json={"tasks": [task("HumanEval/0")]})
        assert r.status_code == 202, r.text
        r = await client.get("/v1/tasks/HumanEval%2F0")
        assert r.status_code == 200 and r.json()["task_id"] == "HumanEval/0"
        assert (await client.post("/v1/evals", json={"min_policy_version": 2**63})).status_code == 422


async def test_empty_batch_is_422(make_config, running):
    async with running(make_config(), kafka=False) as (client, _):
        r = await client.post("/v1/tasks", json={"tasks": []})
        assert r.status_code == 422 and "tasks" in _fields(r)[0]


async def test_202_only_after_commit_a_fresh_registry_sees_the_tasks(make_config, running, task):
    cfg = make_config()
    async with running(cfg, kafka=False) as (client, _):
        r = await client.post("/v1/tasks", json={"tasks": [task("a1"), task(split="eval"), task("a3")]})
        assert r.status_code == 202
        ids = r.json()["task_ids"]
        assert ids[0] == "a1" and ids[2] == "a3" and len(ids[1]) == 32  # uuid4 hex assigned
        fresh = Registry.from_url(cfg.scheduler.database_url, cfg.run)  # a second connection, same file
        try:
            assert fresh.task_counts() == {"train": 2, "eval": 1}
            assert fresh.get_task(ids[1])["split"] == "eval"
        finally:
            fresh.close()
        got = (await client.get("/v1/tasks/a1")).json()
        assert got == {"task_id": "a1", "domain": "toy", "split": "train", "state": "registered", "samples": 0,
                       "passes": 0, "pass_rate": None, "groups_issued": 0}
    assert (cfg.run.path("flywheel-registry.db")).exists()


async def test_repost_is_idempotent_and_conflicting_content_is_409(make_config, running, task):
    async with running(make_config(), kafka=False) as (client, state):
        r1 = await client.post("/v1/tasks", json={"tasks": [task("same")]})
        r2 = await client.post("/v1/tasks", json={"tasks": [task("same")]})
        assert r1.status_code == r2.status_code == 202
        assert r1.json() == r2.json() == {"task_ids": ["same"]}
        r3 = await client.post("/v1/tasks", json={"tasks": [task("new"), task("same", difficulty=3.0)]})
        assert r3.status_code == 409
        assert r3.json()["detail"]["task_ids"] == ["same"]
        assert state.registry.get_task("new") is None  # all or nothing
        r4 = await client.post("/v1/tasks", json={"tasks": [task("dup"), task("dup", samples_per_task=4)]})
        assert r4.status_code == 409 and state.registry.get_task("dup") is None
        assert state.registry.task_counts()["train"] == 1


async def test_unknown_task_and_eval_round_are_404_and_eval_without_eval_tasks_is_409(make_config, running):
    async with running(make_config(), kafka=False) as (client, _):
        assert (await client.get("/v1/tasks/nope")).status_code == 404
        assert (await client.get("/v1/evals/7")).status_code == 404
        assert (await client.post("/v1/evals", json={})).status_code == 409
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/docs")).status_code == 200
        st = (await client.get("/v1/status")).json()
        assert st["policy_version"] == 0 and st["tasks"] == {"train": 0, "eval": 0} and st["trainer"] == {}
        assert (await client.get("/v1/metrics/history")).json() == []


def test_task_create_mirrors_task_fields():
    """TaskCreate must stay the Task record minus schema/version (so validation is identical)."""
    assert set(TaskCreate.model_fields) == set(Task.model_fields) - {"schema_", "schema_version"}
    for name, f in TaskCreate.model_fields.items():
        if name != "task_id":
            assert f.annotation == Task.model_fields[name].annotation, name
            assert f.metadata == Task.model_fields[name].metadata, name
