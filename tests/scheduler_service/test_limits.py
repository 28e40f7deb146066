"""Limits at the scheduler's door: body size, per-field sizes and numeric bounds,
the largest record against the broker's limit, prompts against the context, validation off the event
loop and bounded in time, short 4xx bodies that name the field, never a 500 on client input."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, field_validator

from shared.config import KafkaConfig


def _fields(r) -> list[str]:
    return [".".join(map(str, e["loc"][1:])) for e in r.json()["detail"]]


async def _absent(client, task_id: str) -> bool:
    return (await client.get(f"/v1/tasks/{task_id}")).status_code == 404


async def test_a_body_over_the_limit_is_413_declared_or_chunked(make_config, running, task):
    """Item 5: a 256 MB body used to be parsed (1.8 GB peak). Declared too large: 413 before a byte is read;
    sent chunked without Content-Length: 413 once the received bytes pass the limit."""
    cfg = make_config(scheduler={"max_body_bytes": 64 * 1024})
    async with running(cfg, kafka=False) as (client, state):
        big = json.dumps({"tasks": [task("big", metadata={"x": "a" * 100_000})]}).encode()
        r = await client.post("/v1/tasks", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "65536" in r.text

        sent = []

        async def chunks():
            for i in range(0, len(big), 8192):
                sent.append(i)
                yield big[i:i + 8192]

        r = await client.post("/v1/tasks", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert len(sent) * 8192 <= 64 * 1024 + 8192  # refused at the limit, not after the whole body
        assert await _absent(client, "big")
        ok = json.dumps({"tasks": [task("small")]}).encode()

        async def one():
            yield ok

        r = await client.post("/v1/tasks", content=one(), headers={"content-type": "application/json"})
        assert r.status_code == 202, r.text


async def test_a_task_whose_record_exceeds_the_broker_limit_is_refused_naming_index_and_field(
        make_config, running, task):
    """Item 5: a batch of 256 messages of 100,000 characters got 202 and failed at publishing. Now 422 naming
    the task index and its largest field, nothing of the batch stored. The context is set past any prompt here
    so that only the record bound speaks (a prompt too large for both gets one error: the record's)."""
    wide = {"context_tokens": 10_000_000}
    async with running(make_config(scheduler=wide), kafka=False) as (client, state):
        huge = [{"role": "user", "content": "x" * 100_000}] * 256  # 25.6 MB > 16 MiB
        r = await client.post("/v1/tasks", json={"tasks": [task("fine"), task("huge", prompt=huge)]})
        assert r.status_code == 422, r.text
        assert _fields(r) == ["tasks.1.prompt"] and "kafka.max_request_size" in r.text
        assert len(r.content) < 4000  # no echo of the 25 MB
        assert await _absent(client, "fine") and await _absent(client, "huge")
    # the bound counts the completion: max_tokens × 128 bytes. 200 KB of prompt fits 1 MB records at 24 tokens,
    # not with 8192 tokens of completion (1 MiB)
    cfg = make_config(kafka=KafkaConfig(max_request_size=1024 * 1024), scheduler=wide)
    async with running(cfg, kafka=False) as (client, state):
        two = [{"role": "user", "content": "y" * 50_000}] * 2
        assert (await client.post("/v1/tasks", json={"tasks": [task("short", prompt=two)]})).status_code == 202
        await client.put("/v1/domains/long", json={"max_tokens": 8192})
        r = await client.post("/v1/tasks", json={"tasks": [task("long", domain="long", prompt=two)]})
        assert r.status_code == 422 and _fields(r) == ["tasks.0.prompt"], r.text


async def test_a_17mb_answer_is_refused_and_the_422_echoes_an_excerpt(make_config, running, task):
    """Items 5 and 7: a 17 MB answer was stored; a 64 MB invalid body came back whole in the 422."""
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", json={"tasks": [task("gold", verifier={"kind": "exact",
                                                                                  "answer": "7" * 17_000_000})]})
        assert r.status_code == 422 and _fields(r) == ["tasks.0.verifier.exact.answer"], r.text[:500]
        assert len(r.content) < 2000, len(r.content)
        assert "(17000000 characters)" in r.text
        assert await _absent(client, "gold")


def _char_model(dest):
    """A model directory as far as the scheduler reads it: ``config.json`` (a 512-token context) and a
    character-level ``tokenizer.json`` (``shared.model.build_tiny_model``'s, without the weights)."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers

    dest.mkdir()
    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(["<unk>", *chars])}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.save(str(dest / "tokenizer.json"))
    (dest / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return dest


async def test_a_prompt_longer_than_the_context_is_refused(make_config, running, task, tmp_path):
    """Item 5: prompts longer than the model's context were accepted. The tiny model: a 512-token context
    and one token per character; the check counts the prompt with the model's tokenizer."""
    model_dir = _char_model(tmp_path / "tiny")
    cfg = make_config()
    cfg.model.name = str(model_dir)
    async with running(cfg, kafka=False) as (client, state):
        long = [{"role": "user", "content": "a" * 500}]  # 500 tokens + 24 new > 512
        fits = [{"role": "user", "content": "a" * 480}]
        r = await client.post("/v1/tasks", json={"tasks": [task("fits", prompt=fits), task("long", prompt=long)]})
        assert r.status_code == 422 and _fields(r) == ["tasks.1.prompt"], r.text
        assert "512" in r.text and "500 tokens" in r.text
        assert (await client.post("/v1/tasks", json={"tasks": [task("fits", prompt=fits)]})).status_code == 202
        # too long and too large at once: one error, the record's, and no tokenizing of the 20 MB
        huge = [{"role": "user", "content": "b" * 100_000}] * 200
        r = await client.post("/v1/tasks", json={"tasks": [task("huge", prompt=huge)]})
        assert r.status_code == 422 and _fields(r) == ["tasks.0.prompt"], r.text
        assert r.json()["detail"][0]["type"] == "record_too_large", r.text
        t0 = time.perf_counter()
        state.prompt_counter.tokenizer.encode("a" * 1000)
        assert time.perf_counter() - t0 < 0.05


@pytest.mark.parametrize("verifier, field", [
    ({"kind": "exact", "answer": "a", "recipe": {"judge": {"rubric": "r", "scale_min": 2**70}}},
     "tasks.0.verifier.exact.recipe.judge.scale_min"),
    ({"kind": "exact", "answer": "a", "recipe": {"judge": {"rubric": "r", "scale_min": -(2**70)}}},
     "tasks.0.verifier.exact.recipe.judge.scale_min"),
    ({"kind": "regex", "pattern": "(" * 2000 + ")" * 2000}, "tasks.0.verifier.regex.pattern"),
    ({"kind": "json_fields", "fields": {"revenue": {"type": "number"}}}, "tasks.0.verifier.json_fields.fields"),
])
async def test_client_input_that_was_a_500_or_silently_wrong_is_a_422_naming_the_field(
        make_config, running, task, verifier, field):
    """Item 7: an integer past 64 bits in ``recipe.judge.scale_min`` was a 500 (orjson refuses it); a regex
    nested 2,000 deep crashed the compiler with RecursionError (a 500); a json_fields field without
    ``value`` silently became a gold no answer matches."""
    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", json={"tasks": [task("t", verifier=verifier)]})
        assert r.status_code == 422, r.text
        assert field in _fields(r), r.text
        assert await _absent(client, "t")


async def test_bad_json_is_a_400_that_names_the_problem_and_where(make_config, running, task):
    """Item 7: invalid UTF-8 and deep nesting got a 400 that named nothing."""
    async with running(make_config(), kafka=False) as (client, state):
        raw = json.dumps({"tasks": [task("u")]}).encode().replace(b"say a", b"say \xff")
        r = await client.post("/v1/tasks", content=raw, headers={"content-type": "application/json"})
        at = raw.index(b"\xff")
        assert r.status_code == 400 and "UTF-8" in r.text and f"byte {at}" in r.text, r.text
        deep = {"tasks": [task("d", metadata={"a": json.loads("[" * 100 + "]" * 100)})]}
        r = await client.post("/v1/tasks", json=deep)
        assert r.status_code == 400 and "deeper than 64" in r.text and "$.tasks[0].metadata.a" in r.text, r.text
        r = await client.post("/v1/tasks", content=b'{"tasks": [', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "line 1 column" in r.text
        # the same on a route FastAPI validates itself
        r = await client.post("/v1/evals", content=b'{"min_policy_version": "\xff"}',
                              headers={"content-type": "application/json"})
        assert r.status_code == 400 and "byte 24" in r.text, r.text
        r = await client.put("/v1/domains/x", content=("[" * 2000 + "]" * 2000).encode(),
                             headers={"content-type": "application/json"})
        assert r.status_code == 400 and "deeper than" in r.text, r.text


async def test_healthz_answers_while_a_slow_batch_validates(make_config, running, task):
    """Item 6: a 5 MB regex was compiled on the event loop and /healthz took 26 s. Now a pattern is at most
    10,000 characters (refused above), and a batch is validated in a worker thread: /healthz answers in
    a fraction of the time 30 tasks of long patterns take to compile (1-6 s, with the CPUs shared); on the
    event loop, one poll waited for the whole batch."""
    async with running(make_config(), kafka=False) as (client, state):
        def pattern(i: int) -> str:
            return "|".join(f"w{i}x{j:04d}" for j in range(1000))[:10_000]

        batch = {"tasks": [task(f"p{i}", verifier={"kind": "regex", "pattern": pattern(i)}) for i in range(30)]}
        latencies: list[float] = []
        done = asyncio.Event()

        async def poll():
            while not done.is_set():
                t0 = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)

        async def post():
            t0 = time.perf_counter()
            try:
                return await client.post("/v1/tasks", json=batch), time.perf_counter() - t0
            finally:
                done.set()

        poller = asyncio.create_task(poll())
        (r, took), _ = await asyncio.gather(post(), poller)
        assert r.status_code == 202, r.text[:300]
        assert took > 0.3 and len(latencies) >= 5, (took, latencies)
        assert max(latencies) < took / 3, (max(latencies), took)
        r = await client.post("/v1/tasks", json={"tasks": [task("5mb", verifier={"kind": "regex",
                                                                                "pattern": "a|" * 2_500_000})]})
        assert r.status_code == 422 and "pattern" in _fields(r)[0]


async def test_a_batch_whose_validation_runs_past_the_budget_is_413(make_config, running, task):
    """The batch's validation time is bounded (``scheduler.validation_budget_s``): past it, 413 and nothing
    stored."""
    async with running(make_config(scheduler={"validation_budget_s": 0.2}), kafka=False) as (client, state):
        batch = {"tasks": [task(f"b{i}", verifier={"kind": "regex", "pattern": f"b{i}|" + "|".join(
            f"v{j:05d}" for j in range(1250))}) for i in range(50)]}
        r = await client.post("/v1/tasks", json=batch)
        assert r.status_code == 413 and "validation_budget_s" in r.text, r.text
        assert await _absent(client, "b0")


class Body(BaseModel):
    x: int

    @field_validator("x")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v == 13:
            raise TypeError("unlucky")
        return v


def test_an_unexpected_validator_failure_is_a_422_and_an_endpoint_bug_a_500():
    """Never a 500 on client input (a validator that fails in an unforeseen way, here with a TypeError), but a
    real server bug (the endpoint raising) is still a 500."""
    from shared.http import CheckedRoute, install_validation_handler

    app = FastAPI()
    app.router.route_class = CheckedRoute
    install_validation_handler(app)

    @app.post("/v")
    def v(body: Body) -> dict:
        if body.x == 7:
            raise RuntimeError("server bug")
        return {"x": body.x}

    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/v", json={"x": 1}).json() == {"x": 1}
        r = c.post("/v", json={"x": 13})
        assert r.status_code == 422 and "TypeError: unlucky" in r.text, r.text
        assert c.post("/v", json={"x": 7}).status_code == 500


def test_openapi_lists_the_statuses_and_requires_kind(make_config):
    """Item 7: 404 and 409 were not in the OpenAPI responses, ``kind`` was optional in the schema."""
    from scheduler_service.api import create_app
    from scheduler_service.registry import Registry
    from scheduler_service.state import SchedulerState

    cfg = make_config()
    registry = Registry.from_url(cfg.scheduler.database_url, cfg.run)
    try:
        doc = create_app(cfg, SchedulerState(cfg, registry, kafka=False)).openapi()
    finally:
        registry.close()
    paths = doc["paths"]
    assert {"400", "401", "409", "413", "422"} <= set(paths["/v1/tasks"]["post"]["responses"])
    assert {"401", "409"} <= set(paths["/v1/evals"]["post"]["responses"])
    assert "404" in paths["/v1/tasks/{task_id}"]["get"]["responses"]
    assert "404" in paths["/v1/evals/{round_id}"]["get"]["responses"]
    assert "404" in paths["/v1/domains/{domain}"]["patch"]["responses"]
    with_body = [(p, m) for p, ops in paths.items() for m, op in ops.items() if "requestBody" in op]
    assert ("/v1/system/broker-restarted", "post") in with_body  # a router once lacked the checked route class
    assert [(p, m) for p, m in with_body if "400" not in paths[p][m]["responses"]] == []
    schemas = doc["components"]["schemas"]
    assert paths["/v1/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TaskBatchCreate"}
    for kind in ("RegexSpec", "MathSpec", "ExactSpec", "NumericSpec", "JsonFieldsSpec", "UnitTestsSpec",
                 "GeometrySpec", "ReasoningGymSpec"):
        assert schemas[kind]["required"][0] == "kind", kind
    judge = schemas["JudgeRubric"]["properties"]["scale_min"]
    assert judge["minimum"] >= -(2**53) and judge["maximum"] <= 2**53


async def test_a_task_whose_environment_cannot_be_imported_is_refused_naming_what_is_missing(
        make_config, running, task, tmp_path):
    """A task scored by a user environment is accepted when the scheduler can import it as the verifier will,
    and refused with 422 at ``verifier.environment`` naming the file or attribute when it cannot."""
    env = tmp_path / "env_ok.py"
    env.write_text("from flywheel.env import Environment\n\ndef load_environment():\n"
                   "    return Environment(dataset=[], rubric=lambda completion: 1.0)\n")

    def scored_by(ref: dict, task_id: str) -> dict:
        return task(task_id, verifier={"kind": "environment", "environment": ref, "answer": 4})

    async with running(make_config(), kafka=False) as (client, state):
        r = await client.post("/v1/tasks", json={"tasks": [scored_by({"path": str(env)}, "ok")]})
        assert r.status_code == 202, r.text
        bad = [scored_by({"path": str(tmp_path / "missing.py")}, "a"), scored_by({"path": f"{env}:nope"}, "b"),
               scored_by({"path": str(tmp_path / "missing.py")}, "c"), scored_by({"path": "0" * 4000}, "d")]
        r = await client.post("/v1/tasks", json={"tasks": bad})
        assert r.status_code == 422, r.text
        assert _fields(r) == ["tasks.0.verifier.environment", "tasks.1.verifier.environment",
                              "tasks.2.verifier.environment", "tasks.3.verifier.environment"]
        assert "missing.py' is not a file" in r.text and "has no attribute 'nope'" in r.text
        assert "cannot be read: OSError" in r.text
        assert await _absent(client, "a") and await _absent(client, "b")
