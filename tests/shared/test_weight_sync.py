"""Weight broadcast over gloo between real processes: exact weights, checksums, and a receiver that
dies mid-broadcast or never joins does not hang the trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from flywheel.broker import free_port
from shared.weight_sync import WeightBroadcaster, plan_buckets

RECEIVER = textwrap.dedent("""
    import os, sys, time, torch
    from shared.weight_sync import WeightReceiver
    port, rid, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.manual_seed(0)
    like = {f"w{i}": torch.empty(64, 32) for i in range(8)}
    like["h"] = torch.empty(7, dtype=torch.bfloat16)
    r = WeightReceiver("127.0.0.1", port, rid, timeout_s=3.0, bucket_bytes=16 * 1024)
    open(out + ".ready", "w").close()
    for version in (1, 2):
        while not os.path.exists(f"{out}.go{version}"):
            time.sleep(0.01)
        world = int(open(f"{out}.go{version}").read())
        if mode == "stall":
            time.sleep(60)
        if mode == "die" and version == 1:
            import shared.weight_sync as ws
            real = ws._bcast
            def die_after_first(pg, buf):
                real(pg, buf)
                os.kill(os.getpid(), 9)  # mid-broadcast: one bucket in, many to go
            ws._bcast = die_after_first
        try:
            got = r.receive(version, like, world)
            torch.save(got, f"{out}.v{version}")
        except RuntimeError as e:
            open(f"{out}.v{version}.err", "w").write(str(e))
""")


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    w = {f"w{i}": torch.randn(64, 32, generator=g) for i in range(8)}
    w["h"] = torch.randn(7, generator=g).to(torch.bfloat16)
    return w


def _start(tmp_path, port, rid, mode="ok"):
    out = str(tmp_path / rid)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), rid, mode, out], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(out + ".ready"):
        assert p.poll() is None and time.monotonic() < deadline, "receiver did not start"
        time.sleep(0.02)
    return p, out


def _go(outs, version, world):
    for out in outs:
        with open(f"{out}.go{version}", "w") as f:
            f.write(str(world))


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_buckets_group_by_dtype_and_size():
    w = _weights(1)  # h: 7 bf16; w0..w7: 8 KiB of fp32 each
    plan = plan_buckets(w, 16 * 1024)
    assert [b.names for b in plan] == [("h",), ("w0", "w1"), ("w2", "w3"), ("w4", "w5"), ("w6", "w7")]
    assert [b.dtype for b in plan] == [torch.bfloat16] + [torch.float32] * 4
    assert sum(b.numel for b in plan) == sum(t.numel() for t in w.values())


def test_two_receivers_get_exact_weights_then_a_dead_one_is_dropped(tmp_path, procs):
    port = free_port()
    bc = WeightBroadcaster("127.0.0.1", port, timeout_s=3.0, bucket_bytes=16 * 1024)
    a, out_a = _start(tmp_path, port, "rollout-a")
    b, out_b = _start(tmp_path, port, "rollout-b", mode="die")
    procs += [a, b]
    live = bc.live_receivers()
    assert live == ["rollout-a", "rollout-b"]
    _go([out_a, out_b], 1, 3)
    t0 = time.monotonic()
    res = bc.broadcast(1, _weights(1), live)
    assert not res["ok"] and time.monotonic() - t0 < 10, res  # b died after one bucket: no hang
    assert b.wait(10) == -signal.SIGKILL
    # a fell back (its receive failed too: a session is all or nothing); b's heartbeat stops
    deadline = time.monotonic() + 20
    while not os.path.exists(out_a + ".v1.err") and not os.path.exists(out_a + ".v1"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    deadline = time.monotonic() + 20  # b's last heartbeat ages out; a's keep coming (each second)
    while (live := bc.live_receivers(max_age_s=1.5)) != ["rollout-a"]:
        assert time.monotonic() < deadline, live
        time.sleep(0.1)
    _go([out_a], 2, 2)
    res = bc.broadcast(2, _weights(2), live)
    assert res["ok"], res
    assert res["bytes"] == sum(t.numel() * t.element_size() for t in _weights(2).values())
    deadline = time.monotonic() + 20
    while not os.path.exists(out_a + ".v2"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    got = torch.load(out_a + ".v2")
    for name, t in _weights(2).items():
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype


def test_a_receiver_that_never_joins_times_out(tmp_path, procs):
    port = free_port()
    bc = WeightBroadcaster("127.0.0.1", port, timeout_s=2.0, bucket_bytes=16 * 1024)
    s, out = _start(tmp_path, port, "rollout-stuck", mode="stall")
    procs.append(s)
    _go([out], 1, 2)
    t0 = time.monotonic()
    res = bc.broadcast(1, _weights(1), ["rollout-stuck"])
    assert not res["ok"] and 1.5 < time.monotonic() - t0 < 10, res
