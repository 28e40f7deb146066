"""On the rollout side: a request whose trajectories cannot be produced is dead-lettered,
answered with small error trajectories (so its group fails at once downstream), committed past, and the
service goes on with the next request.

``kafka.max_request_size`` is set a little above the error stand-in's size: the request fits, but a
trajectory with its 400 prompt token ids does not. Before the fix ``publish`` raised
``MessageSizeTooLargeError`` and the service ended.
"""

from __future__ import annotations

import asyncio

import pytest

from flywheel.broker import EmbeddedBroker
from rollout_service.config import RolloutSettings
from rollout_service.main import run
from shared import kafka, topics
from shared.canary import canary_tokens
from shared.model import build_tiny_model, load_tokenizer
from shared.schemas import Attestation, DeadLetter, RolloutRequest, SamplingParams, Task, Trajectory

pytestmark = pytest.mark.kafka


async def test_an_unproducible_trajectory_dead_letters_its_request_and_the_next_request_is_served(tmp_path, read_topic):
    model_dir = build_tiny_model(tmp_path / "tiny")
    long_task = Task(task_id="long", domain="toy", prompt=[{"role": "user", "content": "q" * 400}],
                     verifier={"kind": "regex", "pattern": "^a"})
    short_task = long_task.model_copy(update={"task_id": "short", "prompt": [{"role": "user", "content": "q"}]})
    sp = SamplingParams(max_new_tokens=4)
    big, small = RolloutRequest(group_id="big", task=long_task, n=2, sampling=sp), \
        RolloutRequest(group_id="small", task=short_task, n=2, sampling=sp)
    like = Trajectory(trajectory_id="big:1:0", group_id="big", sample_index=0, group_size=2, task=long_task,
                      prompt_ids=[], completion_ids=[], completion_logprobs=[], loss_mask=[], completion_text="",
                      finish_reason="error", error="x" * 200, policy_versions=[{"version": 0, "start": 0, "end": 0}],
                      timings={"queue": 0.1, "generate": 0.1}, cost={"generated_tokens": 4.0, "tool_rounds": 0.0,
                                                                      "tool_seconds": 0.0})
    # a real trajectory also carries its engine's canary scores (one float per canary token): room for them
    canary = len(canary_tokens(load_tokenizer(model_dir))[1])
    att = Attestation(engine="host:4194304", precision="float32", canary=[{"version": 0, "logprobs": [-1.2345678] * canary}])
    limit = kafka.record_size(like.encode(), "big") + 400 + len(att.model_dump_json())
    full = like.model_copy(update={"prompt_ids": [50] * 400, "attestation": att})
    assert kafka.record_size(full.encode(), "big") > limit > kafka.record_size(big.encode(), "big")

    with EmbeddedBroker.start() as b:
        cfg = RolloutSettings(model={"name": str(model_dir)}, run={"dir": str(tmp_path / "run")},
                              kafka={"bootstrap_servers": b.bootstrap_servers, "partitions": 2,
                                     "max_request_size": limit})
        await kafka.ensure_topics(cfg.kafka)
        stop = asyncio.Event()
        service = asyncio.create_task(run(cfg, stop))
        p = kafka.make_producer(cfg.kafka.model_copy(update={"max_request_size": 16 << 20}))
        await p.start()
        try:
            for r in (big, small):
                await (await kafka.send(p, topics.ROLLOUT_REQUESTS, r, r.group_id))
            trajs = await read_topic(cfg.kafka, topics.TRAJECTORIES, Trajectory, 4, timeout_s=90)
            dead = await read_topic(cfg.kafka, topics.DLQ, DeadLetter, 1, timeout_s=30)
            assert not service.done(), "the rollout service ended"
        finally:
            await p.stop()
            stop.set()
            await asyncio.wait_for(service, 60)
    by = {}
    for t in trajs:
        by.setdefault(t.group_id, []).append(t)
    assert sorted(t.sample_index for t in by["small"]) == [0, 1]
    assert all(t.finish_reason != "error" and t.completion_ids for t in by["small"])
    assert sorted(t.sample_index for t in by["big"]) == [0, 1]
    assert all(t.finish_reason == "error" and t.completion_ids == [] and "MessageSizeTooLargeError" in t.error
               for t in by["big"])
    assert len(dead) == 1 and dead[0].source_topic == topics.ROLLOUT_REQUESTS and dead[0].consumer == "rollout"
    assert "MessageSizeTooLargeError" in dead[0].reason and str(limit) in dead[0].reason
