"""The trainer ends each group's trace: a ``train_group`` span under the context of the group's scored
records, for trained and dropped groups, and a ``train_step`` root per step."""

from __future__ import annotations

import json
import sqlite3

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from shared.schemas import Reward, ScoredTrajectory, Task, Trajectory
from shared.spans import SpanStore, SqliteSpanExporter
from trainer_service.groups import GroupBuffer
from trainer_service.tracing import GroupTraces


def _scored(gid, i, reward, version=0, purpose="train", error=False):
    task = Task(task_id="t", domain="code", prompt=[{"role": "user", "content": "q"}],
                verifier={"kind": "regex", "pattern": "^a"})
    tr = Trajectory(trajectory_id=f"{gid}:1:{i}", group_id=gid, sample_index=i, group_size=2, task=task,
                    prompt_ids=[5, 6], completion_ids=[7, 8], completion_logprobs=[-4.0, -4.0], loss_mask=[1, 1],
                    completion_text="xy", finish_reason="stop", purpose=purpose,
                    policy_versions=[{"version": version, "start": 0, "end": 2}])
    return ScoredTrajectory(trajectory=tr, reward=Reward(total=reward, infra_error=error))


def test_trained_and_dropped_groups_end_their_traces(tmp_path):
    path = tmp_path / "traces.sqlite"
    provider = TracerProvider(resource=Resource.create({"service.name": "trainer"}), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(SqliteSpanExporter(path)))
    tracer = provider.get_tracer("test")
    traces, buf = GroupTraces(tracer), GroupBuffer(max_staleness=0)

    def feed(gid, records):
        """Records of one group, sent (like the verifier) inside a span of the group's trace."""
        with tracer.start_as_current_span("issue_group", context=otel_context.Context(),
                                          attributes={"group_id": gid}) as root:
            for off, rec in enumerate(records):
                with tracer.start_as_current_span("verify", attributes={"group_id": gid}):
                    headers = {}
                    propagate.inject(headers)
                    traces.remember(rec, [(k, v.encode()) for k, v in headers.items()], buf)
                    buf.add(rec, ("flywheel.scored", 0), off)
        return root.get_span_context()

    trained = feed("g-train", [_scored("g-train", 0, 1.0, version=1), _scored("g-train", 1, 0.0, version=1)])
    stale = feed("g-stale", [_scored("g-stale", 0, 1.0), _scored("g-stale", 1, 1.0)])
    failed = feed("g-failed", [_scored("g-failed", 0, 0.0, error=True)])
    feed("g-eval", [_scored("g-eval", 0, 1.0, purpose="eval")])
    assert set(traces.contexts) == {"g-train", "g-stale", "g-failed"}  # eval groups are never trained
    buf.drop_stale(version=1)
    traces.dropped(buf.take_drops(), step=3, version=1)
    groups = buf.take(1)
    traces.trained(groups, step=4, version=2, start_ns=10, end_ns=20)
    traces.step(groups, step=4, version=2, start_ns=10, end_ns=30, seconds={"time/train_step_s": 1.5})
    assert traces.contexts == {}
    # a redelivered record of a finished group is not remembered again
    traces.remember(_scored("g-train", 0, 1.0), [], buf)
    assert traces.contexts == {}

    store = SpanStore(path)
    for ctx, outcome in ((trained, {"outcome": "trained", "step": 4, "policy_version": 2, "samples": 2,
                                    "reward_mean": 0.5, "domain": "code", "behaviour_version": 1}),
                         (stale, {"outcome": "dropped", "reason": "stale", "step": 3, "policy_version": 1,
                                  "samples": 2, "behaviour_version": 0}),
                         (failed, {"outcome": "dropped", "reason": "failed", "samples": 1})):
        spans = store.trace(f"{ctx.trace_id:032x}")
        (train,) = [s for s in spans if s["name"] == "train_group"]
        verify_ids = {s["span_id"] for s in spans if s["name"] == "verify"}
        assert train["parent_id"] in verify_ids  # the first record's verify span
        assert train["group_id"] == spans[0]["group_id"] and train["service"] == "trainer"
        assert outcome.items() <= train["attributes"].items()
    (train,) = [s for s in store.group_trace("g-train") if s["name"] == "train_group"]
    assert (train["start_ns"], train["end_ns"]) == (10, 20)
    (eval_trace,) = [g for g in store.recent_groups() if g["group_id"] == "g-eval"]
    assert eval_trace["spans"] == 2  # issue + verify: no train_group
    with_steps = [s for g in store.recent_groups() for s in store.trace(g["trace_id"])]
    assert not any(s["name"] == "train_step" for s in with_steps)  # the step span is a trace of its own
    with sqlite3.connect(path) as db:
        (parent, attrs), = db.execute("SELECT parent_id, attributes FROM spans WHERE name = 'train_step'").fetchall()
    assert parent is None and json.loads(attrs) == {"step": 4, "policy_version": 2, "groups": ["g-train"],
                                                    "time/train_step_s": 1.5}
    provider.shutdown()
