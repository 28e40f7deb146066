"""One trace per group, through all five services, in the live system's local span store.

The ``observed`` system runs with the default ``telemetry.traces: auto`` and no OTLP endpoint, so every
service writes its spans to ``<run dir>/traces.sqlite``. A ``code`` training group's trace must hold the
scheduler's ``issue_group`` root, the rollout span, one ``verify`` span per sample, the sandbox's spans
for those verifications and the trainer's ``train_group`` span, linked into one tree; an eval group's
trace the same without the trainer.
"""

from __future__ import annotations

import time

from shared.spans import SpanStore

FIVE = {"scheduler", "rollout", "verifier", "sandbox", "trainer"}
RECENT = 100_000
"""Groups searched, newest first: every group the package's system issued (a few thousand an hour; with a
smaller window a slow machine's run had pushed the eval rounds' groups out of it)."""
CLOCK_SLACK_NS = 1_000_000
"""Float seconds (``issued_at``) against integer ns: a child may appear to start up to 1 ms early."""


def _find(store: SpanStore, want, timeout_s: float = 60.0) -> dict:
    """The newest group summary of ``store.recent_groups`` satisfying ``want`` (spans are written about
    once a second by each process's batch processor, so poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        groups = store.recent_groups(RECENT)
        hit = next((g for g in groups if want(g)), None)
        if hit is not None:
            return hit
        if time.monotonic() > deadline:
            seen = {(g["domain"], g["purpose"], tuple(g["services"])) for g in groups}
            raise AssertionError(f"no such group trace after {timeout_s:.0f} s; seen {sorted(seen)}")
        time.sleep(1.0)


def _assert_one_tree(spans: list[dict]) -> dict:
    """Every parent is a span of the same trace, there is one root, every span reaches it, no child
    starts before its parent. Returns the root."""
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "duplicate span ids"
    assert len({s["trace_id"] for s in spans}) == 1
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == 1, [(s["name"], s["service"]) for s in roots]
    for s in spans:
        assert s["parent_id"] is None or s["parent_id"] in by_id, f"{s['name']} has a parent outside the trace"
        seen, node = set(), s
        while node["parent_id"] is not None:  # walks up to the root without a cycle
            assert node["span_id"] not in seen
            seen.add(node["span_id"])
            parent = by_id[node["parent_id"]]
            assert node["start_ns"] >= parent["start_ns"] - CLOCK_SLACK_NS, (node["name"], parent["name"])
            node = parent
        assert node is roots[0]
        assert s["end_ns"] >= s["start_ns"]
    return roots[0]


def _whole(spans: list[dict], trained: bool) -> bool:
    """Every span of the group's trace has reached the store: the root, a verify and a sandbox span per
    sample, every span's parent and, with ``trained``, the trainer's ``train_group`` (outcome ``trained``).
    Each process exports its spans on its own clock (about once a second), so a later span (the trainer's,
    or the sandbox's inside a verify) can land before an earlier one; a trace read then is not yet whole.
    A service that never writes a span leaves no whole trace and :func:`_find` fails."""
    ids = {s["span_id"] for s in spans}
    k = next((s["attributes"].get("n", 0) for s in spans if s["name"] == "issue_group"), 0)  # the group's size
    samples = {s["attributes"].get("sample_index") for s in spans if s["name"] == "verify"}
    return (k > 0 and set(range(k)) <= samples and sum(s["name"] == "sandbox.execute" for s in spans) >= k
            and all(s["parent_id"] is None or s["parent_id"] in ids for s in spans)
            and (not trained or any(s["name"] == "train_group" and s["attributes"].get("outcome") == "trained"
                                    for s in spans)))


def test_a_code_groups_trace_spans_all_five_services_as_one_tree(observed):
    store = SpanStore(observed.run_dir / "traces.sqlite")
    summary = _find(store, lambda g: g["domain"] == "code" and g["purpose"] == "train" and FIVE <= set(g["services"])
                    and _whole(store.trace(g["trace_id"]), trained=True))
    spans = store.trace(summary["trace_id"])  # the trace found whole (a re-issue starts another)
    gid = summary["group_id"]
    assert {s["service"] for s in spans} == FIVE
    root = _assert_one_tree(spans)

    assert (root["name"], root["service"], root["group_id"]) == ("issue_group", "scheduler", gid)
    assert {"domain": "code", "purpose": "train", "group_id": gid}.items() <= root["attributes"].items()
    assert isinstance(root["attributes"]["policy_version"], int)
    k = root["attributes"]["n"]  # the group's size (code: K = 2)
    by_id = {s["span_id"]: s for s in spans}
    named = {}
    for s in spans:
        named.setdefault(s["name"], []).append(s)
    (rollout,) = named["rollout"]
    assert rollout["parent_id"] == root["span_id"] and rollout["service"] == "rollout"
    verifies = named["verify"]
    assert len(verifies) >= k and {v["attributes"]["sample_index"] for v in verifies} == set(range(k))
    assert all(v["parent_id"] == rollout["span_id"] and v["attributes"]["verifier.kind"] == "unit_tests"
               for v in verifies)
    sandbox = named["sandbox.execute"]
    assert len(sandbox) >= k and all(by_id[s["parent_id"]]["name"] == "verify" for s in sandbox)
    (train,) = named["train_group"]
    assert by_id[train["parent_id"]]["name"] == "verify" and train["service"] == "trainer"
    assert train["attributes"]["outcome"] == "trained" and train["attributes"]["step"] >= 1
    # the group_id column is filled wherever the service knows the group (the sandbox does not)
    assert all(s["group_id"] == gid for s in spans if s["service"] != "sandbox")
    assert (summary["start_ns"], summary["end_ns"]) == (min(s["start_ns"] for s in spans),
                                                        max(s["end_ns"] for s in spans))


def test_an_eval_groups_trace_is_one_tree_through_the_sandbox(observed):
    store = SpanStore(observed.run_dir / "traces.sqlite")
    summary = _find(store, lambda g: g["domain"] == "code" and g["purpose"] == "eval"
                    and {"scheduler", "rollout", "verifier", "sandbox"} <= set(g["services"])
                    and _whole(store.trace(g["trace_id"]), trained=False))
    spans = store.trace(summary["trace_id"])  # the trace found whole (a re-issue starts another)
    root = _assert_one_tree(spans)
    assert root["attributes"]["purpose"] == "eval" and "eval_round" in root["attributes"]
    assert "trainer" not in {s["service"] for s in spans}  # eval samples are never trained


def test_polls_add_no_spans_and_requests_add_no_operation_spans(observed):
    """The fixture polls ``GET /v1/status`` and ``GET /v1/evals/{id}`` and the launcher ``GET /healthz``:
    none of them is traced (:func:`shared.telemetry.untraced_request`); FastAPI's per-operation spans are off."""
    import sqlite3

    with sqlite3.connect(observed.run_dir / "traces.sqlite") as db:
        names = dict(db.execute("SELECT name, COUNT(*) FROM spans GROUP BY name").fetchall())
    assert names.get("issue_group", 0) > 0 and names.get("POST /v1/execute", 0) > 0
    assert not [n for n in names if n.startswith(("GET ", "HEAD ", "fastapi."))], names
