"""The drift guard over REST without Kafka: operator control, and breakers, alerts and the training pause
surviving a scheduler restart (they live in the registry)."""

from __future__ import annotations


async def test_breaker_alerts_and_pause_survive_a_restart(make_config, running, task):
    cfg = make_config()
    async with running(cfg, kafka=False) as (client, state):
        assert (await client.post("/v1/tasks", json={"tasks": [task("a1", domain="dA"), task("b1", domain="dB")]})
                ).status_code == 202
        r = await client.post("/v1/domains/dA/breaker/open", params={"reason": "looks odd"})
        assert r.status_code == 200 and r.json()["breaker"]["state"] == "open" and r.json()["breaker"]["manual"]
        assert "dA" in state.guard.blocked
        r = await client.post("/v1/training/pause", params={"reason": "checking"})
        assert r.status_code == 200 and r.json()["applied"] is True
        r = await client.post("/v1/control", json={"command": "set_threshold", "signal": "hack_rate",
                                                   "threshold": {"critical": 0.4}})
        assert r.status_code == 200 and r.json()["thresholds"]["critical"] == 0.4
        assert (await client.post("/v1/domains/nope/breaker/open")).status_code == 404
        before = (await client.get("/v1/alerts")).json()
        assert (await client.get("/v1/status")).json()["alerts"]["firing"] == ["dA/breaker", "run/training_paused"]
    assert [a["key"] for a in before["active"]] == ["dA/breaker", "run/training_paused"]
    async with running(cfg, kafka=False) as (client, state):  # the same registry file: a restart
        st = (await client.get("/v1/status")).json()
        assert st["breakers"] == {"dA": "open"} and st["training_paused"]["reason"] == "checking"
        assert st["alerts"]["critical"] == 1 and st["alerts"]["firing"] == ["dA/breaker", "run/training_paused"]
        mon = (await client.get("/v1/monitor")).json()
        assert mon["signals"]["hack_rate"]["critical"] == 0.4 and mon["breakers"]["dA"]["signal"] == "operator"
        assert "dA" in state.guard.blocked and state.guard.monitor.due_probes() == []  # manual: never probed
        r = await client.post("/v1/domains/dA/breaker/close")
        assert r.json()["breaker"]["state"] == "closed" and "dA" not in state.guard.blocked
        assert (await client.post("/v1/training/resume")).json()["applied"] is True
        after = (await client.get("/v1/alerts", params={"domain": "dA"})).json()
        assert after["active"] == [] and [a["status"] for a in after["recent"]][:2] == ["resolved", "firing"]
        events = (await client.get("/v1/domains/dA")).json()["events"]
        assert {"breaker_open", "breaker_closed"} <= {e["kind"] for e in events}
