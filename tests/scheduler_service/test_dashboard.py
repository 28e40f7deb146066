"""The dashboard without a browser: the incremental reward series against a hand count, and the REST routes
over a real registry and span store (no broker: ``kafka=False``)."""

from __future__ import annotations

import json

import pytest

from scheduler_service import dashboard_data
from scheduler_service.dashboard_data import RewardSeries
from scheduler_service.routes import dashboard
from shared.schemas import RewardEvent
from shared.spans import connect


def _row(rowid, gid, v, reward, tokens, h, n=2, domain="toy", purpose="train", infra=False, t=1000.0):
    return {"rowid": rowid, "group_id": gid, "domain": domain, "purpose": purpose, "n": n, "passed": reward >= 1,
            "reward": reward, "infra_error": infra, "policy_version": v, "received_at": t,
            "completion_tokens": tokens, "completion_hash": h}


def test_curves_match_a_hand_count():
    s = RewardSeries()
    rows = [_row(1, "a:0", 0, 1.0, 4, "x"), _row(2, "a:0", 0, 0.0, 6, "x"),  # 1 distinct of 2
            _row(3, "b:0", 0, 1.0, 2, "y"), _row(4, "b:0", 0, 1.0, 4, "z"),  # 2 distinct of 2
            _row(5, "c:0", 1, 0.5, 8, "w", n=3), _row(6, "c:0", 1, 0.0, 8, None, n=3, infra=True),
            _row(7, "e:0", 0, 1.0, 9, "e", n=1, purpose="eval")]
    assert s.add(rows[:3]) == 3 and s.add(rows[3:]) == 4 and s.cursor == 7
    (p0, p1), = s.curves().values()
    assert p0 == {"policy_version": 0, "samples": 4, "groups": 2, "reward_mean": 0.75, "pass_rate": 0.75,
                  "length_mean": 4.0, "diversity": 0.75}
    # group c has one infra error and one sample to come: scored values count, its diversity does not yet
    assert (p1["samples"], p1["reward_mean"], p1["length_mean"], p1["groups"], p1["diversity"]) == (1, 0.5, 8, 0, None)
    s.add([_row(8, "c:0", 1, 1.0, 10, "w", n=3)])
    assert s.curves()["toy"][1]["diversity"] == 0.5  # two scored samples, both "w"
    assert sum(b["samples_per_s"] for b in s.throughput(now=1005.0)) * s.bin_s == 7  # 8 rows, 1 infra error
    assert sum(b["groups_per_s"] for b in s.throughput(now=1005.0)) * s.bin_s == 4  # a, b, c and the eval


def test_versions_merge_into_ranges_with_exact_means():
    s = RewardSeries()
    s.add([_row(i + 1, f"g:{i}", i, float(i % 2), i, str(i), n=1) for i in range(10)])
    pts = s.curves(max_points=3)["toy"]
    assert [p["policy_version"] for p in pts] == [0, 4, 8]  # width ceil(10 / 3) = 4
    assert [p["samples"] for p in pts] == [4, 4, 2]
    assert [p["reward_mean"] for p in pts] == [0.5, 0.5, 0.5] and pts[2]["length_mean"] == 8.5


def test_the_accumulators_widen_their_version_ranges_when_a_run_outgrows_them(monkeypatch):
    monkeypatch.setattr(dashboard_data, "MAX_VERSIONS", 4)
    s = RewardSeries()
    s.add([_row(i + 1, f"g:{i}", i, float(i % 2), i, str(i), n=1) for i in range(10)])
    assert s.version_width == 4  # 10 versions: ranges of 1, then 2 (5 ranges), then 4 (3 ranges)
    pts = s.curves()["toy"]
    assert [(p["policy_version"], p["samples"], p["reward_mean"]) for p in pts] == [(0, 4, 0.5), (4, 4, 0.5),
                                                                                      (8, 2, 0.5)]
    assert pts[0]["length_mean"] == 1.5  # tokens 0..3: exact means after the merges


def test_throughput_bins_double_when_the_run_outgrows_them(monkeypatch):
    monkeypatch.setattr(dashboard_data, "MAX_BINS", 8)
    s = RewardSeries(bin_s=1.0)
    s.add([_row(i + 1, f"g:{i}", 0, 1.0, 1, str(i), n=1, t=100.0 + i) for i in range(20)])  # 20 s, 1 sample/s
    assert s.bin_s == 4.0  # 20 one-second bins > 8 -> 2 s (10 bins) -> 4 s (5 bins)
    bins = s.throughput(now=120.0)
    assert [(b["t"], b["samples_per_s"], b["groups_per_s"]) for b in bins] == [
        (t, 1.0, 1.0) for t in (100.0, 104.0, 108.0, 112.0, 116.0)]  # merged sums: nothing lost
    s.add([_row(21, "g:21", 0, 1.0, 1, "z", n=1, t=121.0)])
    assert s.throughput(now=122.0)[-1]["samples_per_s"] == 0.5  # the newest bin: 1 sample over its 2 s so far


def _ev(gid: str, i: int, n: int, reward: float, v: int, h: str, tokens: int = 3, purpose: str = "train",
        domain: str = "toy", eval_round: int | None = None) -> RewardEvent:
    return RewardEvent(task_id=gid.rsplit(":", 1)[0], group_id=gid, trajectory_id=f"{gid}:{i}", sample_index=i,
                       group_size=n, domain=domain, difficulty=0.0, purpose=purpose, eval_round=eval_round,
                       reward=reward, passed=reward >= 1.0, completion_tokens=tokens, finish_reason="stop",
                       policy_version=v, completion_hash=h)


def _spans(path, gid: str) -> None:
    rows = [("a" * 32, "1" * 16, None, "issue_group", "scheduler", 0, 5_000_000, "OK", json.dumps(
                {"group_id": gid, "domain": "toy", "purpose": "train"}), gid),
            ("a" * 32, "2" * 16, "1" * 16, "generate", "rollout", 1_000_000, 4_000_000, "OK", "{}", gid),
            ("a" * 32, "3" * 16, "2" * 16, "verify", "verifier", 4_000_000, 4_500_000, "UNSET", "{}", gid)]
    with connect(path) as conn:
        conn.executemany("INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


async def test_the_routes_over_a_registry_and_a_span_store(make_config, running, task, monkeypatch):
    monkeypatch.setattr(dashboard, "CACHE_S", 0.0)
    async with running(make_config(), kafka=False) as (client, state):
        reg = state.registry
        assert (await client.post("/v1/tasks", json={"tasks": [task("t1"), task("t2"), task(
            "e1", split="eval", samples_per_task=2)]})).status_code == 202
        g1, g2 = (g.group_id for g in reg.issue_train_groups(["t1", "t2"], deadline_s=60))
        for ev in (_ev(g1, 0, 2, 1.0, 0, "x", 4), _ev(g1, 1, 2, 0.0, 0, "x", 6), _ev(g2, 0, 2, 1.0, 1, "p"),
                   _ev(g2, 0, 2, 1.0, 1, "p")):  # the last is a redelivery: counted once
            reg.record_reward(ev)
        rid = reg.create_eval_round(0)
        (eg,) = reg.take_pending(60)
        reg.record_reward(_ev(eg.group_id, 0, 1, 1.0, 1, "q", purpose="eval", eval_round=rid))

        d = (await client.get("/v1/dashboard/data")).json()
        assert d["curves"]["toy"][0] == {"policy_version": 0, "samples": 2, "groups": 1, "reward_mean": 0.5,
                                              "pass_rate": 0.5, "length_mean": 5.0, "diversity": 0.5}
        assert d["curves"]["toy"][1]["samples"] == 1 and d["curves"]["toy"][1]["diversity"] is None
        assert [(e["eval_round"], e["accuracy"], e["done"], e["domains"]) for e in d["evals"]] == [
            (rid, 1.0, True, {"toy": {"accuracy": 1.0, "completed": 1}})]
        assert {(r["domain"], r["purpose"], r["samples"]) for r in d["spend"]} == {("toy", "train", 3),
                                                                                   ("toy", "eval", 1)}
        assert [b["domain"] for b in d["breakers"]] == ["toy"] and d["breakers"][0]["state"] == "closed"
        assert d["alerts"] == {"active": [], "recent": []}
        assert d["status"]["samples_scored"] == reg.samples_scored() == 4
        assert d["status"]["in_flight_groups"] == 1  # g2 waits for a sample
        assert d["traces"] == {"available": False, "groups": []} and d["build_ms"] >= 0

        reg.record_reward(_ev(g2, 1, 2, 0.0, 1, "r"))  # read incrementally: only the new row is added
        d = (await client.get("/v1/dashboard/data")).json()
        assert (d["curves"]["toy"][0]["samples"], d["curves"]["toy"][1]["samples"]) == (2, 2)
        assert d["curves"]["toy"][1]["diversity"] == 1.0

        assert (await client.get(f"/v1/dashboard/trace/{g1}")).json()["spans"] == []  # no span store yet
        _spans(state.config.run.path(state.config.telemetry.span_store), g1)
        t = (await client.get(f"/v1/dashboard/trace/{g1}")).json()
        assert t["services"] == ["rollout", "scheduler", "verifier"]
        assert [(s["name"], s["start_ms"], s["duration_ms"]) for s in t["spans"]] == [
            ("issue_group", 0.0, 5.0), ("generate", 1.0, 3.0), ("verify", 4.0, 0.5)]
        d = (await client.get("/v1/dashboard/data")).json()
        assert [(g["group_id"], g["domain"]) for g in d["traces"]["groups"]] == [(g1, "toy")]


@pytest.mark.parametrize("name, media, needle", [("", "text/html", "dashboard/plotly.min.js"),
                                                 ("/dashboard.js", "text/javascript", "Plotly.react"),
                                                 ("/dashboard.css", "text/css", ".card"),
                                                 ("/plotly.min.js", "text/javascript", "plotly.js v")])
async def test_the_page_and_its_scripts_are_served(make_config, running, name, media, needle):
    async with running(make_config(), kafka=False) as (client, _):
        r = await client.get(f"/dashboard{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media)
        assert needle in r.text[:2_000_000]
        assert (await client.get("/dashboard/nothing.js")).status_code == 404


def test_setuptools_ships_the_page_as_package_data():
    """A wheel (or the Docker image's ``pip install .``) must carry scheduler_service/dashboard/*: the
    patterns of ``[tool.setuptools.package-data]`` cover every file of it."""
    import fnmatch
    import tomllib

    root = dashboard.STATIC.parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {}).get(
        "package-data", {}).get("scheduler_service", [])
    files = [p.relative_to(dashboard.STATIC.parent).as_posix() for p in dashboard.STATIC.iterdir()]
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert files and not missing, (f"not package data: {missing}; pyproject.toml needs [tool.setuptools.package-data]"
                                   ' scheduler_service = ["dashboard/*.html", "dashboard/*.js", "dashboard/*.css"]')
