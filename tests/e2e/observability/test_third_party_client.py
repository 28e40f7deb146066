"""A third-party analyst's client against the live system: confluent-kafka (librdkafka) reads the topics and
every record is checked with jsonschema against the published docs/schemas/, with no project code on the
reading side (plain ``json.loads``; the record's ``schema`` names its file's ``x-flywheel-schema``).

Partitions are ``assign()``-ed from offset 0: a consumer group takes about 23 s to join on the embedded
broker. Its end offsets are low (the base offset of the partition's last batch + 1, shared/notes
"tansu-broker"), and the live system keeps writing, so each partition is read until the record at its end
offset at the start minus one has arrived (the whole of that batch comes in the same fetch). (It used to stop
after a quiet spell of 3 s too, which a slow first fetch could end early.)
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
from jsonschema import Draft202012Validator

from shared.schema_export import SCHEMA_DIR

confluent_kafka = pytest.importorskip("confluent_kafka")

TOPICS = ("flywheel.tasks", "flywheel.rewards", "flywheel.metrics", "flywheel.alerts")


def _read(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[tuple[dict, float]]:
    """Every record of ``topic`` so far: ``(JSON object, the record's create time in Unix seconds)``, each
    partition from offset 0, no consumer group."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "third-party-analyst", "enable.auto.commit": False,
                  "client.id": "third-party-analyst"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        # the last offset to wait for, per partition (-1: empty)
        todo = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] - 1 for p in parts}
        todo = {p: end for p, end in todo.items() if end >= 0}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, deadline = [], time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:  # to every partition's end as read at the start
            msg = c.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append((json.loads(msg.value()), msg.timestamp()[1] / 1000))
            if msg.offset() >= todo.get(msg.partition(), msg.offset() + 1):
                del todo[msg.partition()]
        assert not todo, f"{topic}: partitions not read to their end in {timeout_s:.0f} s: {todo}"
        drain_until = time.monotonic() + 1.0  # the rest of the last fetch (the end batch's other records)
        while time.monotonic() < drain_until and (msg := c.poll(0.1)) is not None:
            assert msg.error() is None, msg.error()
            out.append((json.loads(msg.value()), msg.timestamp()[1] / 1000))
        return out
    finally:
        c.close()


def _validators() -> dict[str, Draft202012Validator]:
    """``{record SCHEMA name: validator}`` of every published file."""
    out = {}
    for path in SCHEMA_DIR.glob("*.json"):
        schema = json.loads(path.read_text())
        Draft202012Validator.check_schema(schema)
        out[schema["x-flywheel-schema"]] = Draft202012Validator(schema)
    return out


def test_confluent_kafka_reads_the_topics_and_every_record_matches_its_published_schema(observed):
    bootstrap = observed.system.env["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"]
    validators = _validators()
    topic_schema = {json.loads(p.read_text())["x-flywheel-topic"]: json.loads(p.read_text())["x-flywheel-schema"]
                    for p in SCHEMA_DIR.glob("*.json")}
    read, seconds = {}, {}
    for t in TOPICS:
        t0 = time.monotonic()
        read[t] = _read(bootstrap, t)
        seconds[t] = time.monotonic() - t0
    for _ in range(10):  # a round's records follow its end by up to ~1 s (the scheduler looks once a second)
        rounds = {(m["values"]["eval/round"], m["domain"]) for m, _ in read["flywheel.metrics"]
                  if m["source"] == "scheduler" and "eval/round" in m["values"]}
        if all((r, d) in rounds for r in observed.eval_rounds for d in (None, "toy", "code")):
            break
        time.sleep(1.0)
        read["flywheel.metrics"] = _read(bootstrap, "flywheel.metrics")
    records = {t: [obj for obj, _ in recs] for t, recs in read.items()}
    for topic, recs in records.items():
        for obj in recs:
            assert obj["schema"] == topic_schema[topic], (topic, obj.get("schema"))
            errors = sorted(validators[obj["schema"]].iter_errors(obj), key=lambda e: e.json_path)
            assert not errors, f"{topic}: {[f'{e.json_path}: {e.message}' for e in errors[:3]]}"
    counts = {t: len(r) for t, r in records.items()}
    print(f"\nconfluent-kafka {confluent_kafka.__version__} (librdkafka {confluent_kafka.libversion()[0]}) read and "
          "validated: " + ", ".join(f"{t} {counts[t]} in {seconds[t]:.2f} s" for t in TOPICS))
    assert counts["flywheel.tasks"] >= 64 and counts["flywheel.rewards"] and counts["flywheel.metrics"], counts

    # flywheel.rewards: the analyst's fields, filled by the verifier
    rewards = records["flywheel.rewards"]
    kinds = {(r["domain"], r["verifier_kind"]) for r in rewards}
    assert kinds == {("toy", "regex"), ("code", "unit_tests")}, kinds
    # scored, then sent: the event time is at most the record's create time, and close to it
    lags = [ts - r["event_time"] for r, ts in read["flywheel.rewards"]]
    assert all(-0.01 <= lag < 30 for lag in lags), (min(lags), max(lags))
    scored = [r for r in rewards if not r["infra_error"]]
    assert scored and all("correctness" in r["components"] for r in scored)
    assert all(isinstance(r["gates"], list) and isinstance(r["hacks"], list) for r in rewards)

    # flywheel.metrics: one run-wide and one per-domain eval record per finished round, matching REST
    metrics = records["flywheel.metrics"]
    evals = [m for m in metrics if m["source"] == "scheduler" and "eval/round" in m["values"]]
    seen = Counter((int(m["values"]["eval/round"]), m["domain"]) for m in evals)
    for rid in observed.eval_rounds:
        assert seen[(rid, None)] == seen[(rid, "toy")] == seen[(rid, "code")] == 1, seen
        rest = httpx.get(f"{observed.url}/v1/evals/{rid}", timeout=30).json()
        run_wide = next(m for m in evals if m["values"]["eval/round"] == rid and m["domain"] is None)
        assert run_wide["values"]["eval/n"] == rest["completed"]
        assert run_wide["values"].get("eval/accuracy") == rest["accuracy"]
        assert run_wide["policy_version"] == max(rest["policy_versions"] or [rest["min_policy_version"]])
        per_domain = [m for m in evals if m["values"]["eval/round"] == rid and m["domain"] is not None]
        assert sum(m["values"]["eval/n"] for m in per_domain) == rest["completed"]
    per_domain_train = [m for m in metrics if m["source"] == "trainer" and m["domain"] is not None]
    assert {m["domain"] for m in per_domain_train} <= {"toy", "code"} and per_domain_train
    assert all(m["values"]["train/samples"] >= 1 and 0 <= m["values"]["train/pass_rate"] <= 1
               and "train/completion_tokens_mean" in m["values"] for m in per_domain_train)
    run_wide_steps = {m["step"] for m in metrics if m["source"] == "trainer" and m["domain"] is None}
    assert {m["step"] for m in per_domain_train} <= run_wide_steps  # next to, not instead of, the run-wide record
    gauges = [m for m in metrics if m["source"] == "scheduler" and "scheduler/policy_version" in m["values"]]
    assert gauges and gauges[-1]["values"]["scheduler/groups_issued"] >= 1
    print(f"flywheel.metrics: {len(evals)} eval, {len(per_domain_train)} per-domain trainer, {len(run_wide_steps)} "
          f"run-wide trainer steps, {len(gauges)} scheduler gauge records; reward lag p50 "
          f"{sorted(lags)[len(lags) // 2] * 1000:.1f} ms, max {max(lags) * 1000:.1f} ms")
