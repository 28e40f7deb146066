"""``flywheel.broker.free_port``: ports a server binds later, drawn where outgoing connections never land."""

from __future__ import annotations

import random
import socket

import pytest

from flywheel import broker
from flywheel.broker import FREE_PORT_MIN, KNOWN_PORTS, ephemeral_port_range, free_port, port_is_free


def test_free_ports_lie_below_the_ephemeral_range_are_bindable_and_never_repeat(monkeypatch):
    low, high = ephemeral_port_range()
    assert 1024 <= low <= high <= 65535
    if low - FREE_PORT_MIN < 1024:
        pytest.skip(f"the ephemeral range starts at {low}: free_port lets the kernel pick")
    monkeypatch.setattr(broker, "_handed_out", set())  # no clearing of the memory during the 300 picks
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(FREE_PORT_MIN <= p < low for p in ports), [p for p in ports if not FREE_PORT_MIN <= p < low]
    assert not set(ports) & KNOWN_PORTS
    assert all(port_is_free(p) for p in ports[:20])


def test_known_and_reserved_ports_are_never_drawn(monkeypatch, tmp_path):
    """With the draw confined to a few ports, the known and the administrator's reserved ones are skipped."""
    low, _ = ephemeral_port_range()
    if low - FREE_PORT_MIN < 1024:
        pytest.skip(f"the ephemeral range starts at {low}: free_port lets the kernel pick")
    reserved = tmp_path / "ip_local_reserved_ports"
    reserved.write_text("10001,10003-10004\n")
    monkeypatch.setattr(broker, "_RESERVED_PORTS", str(reserved))
    assert broker.reserved_ports() == {10001, 10003, 10004}
    monkeypatch.setattr(broker, "_handed_out", set())

    class Draw:  # the draw sees only 10000-10005, 16686 and 30000
        pool = [10000, 10001, 10002, 10003, 10004, 10005, 16686, 30000]

        def randrange(self, a: int, b: int) -> int:
            return random.choice(self.pool)

    monkeypatch.setattr(broker, "_port_rng", Draw())
    got = {free_port() for _ in range(3)}
    assert got <= {10000, 10002, 10005}, got


def test_a_port_is_not_free_while_a_listener_or_a_connections_local_end_holds_it():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    listening = server.getsockname()[1]
    assert not port_is_free(listening)

    client = socket.socket()
    client.connect(server.getsockname())  # the kernel gives it an ephemeral local port, as a Kafka client's gets
    accepted, _ = server.accept()
    local = client.getsockname()[1]
    assert not port_is_free(local)
    client.close()
    accepted.close()
    server.close()
    assert port_is_free(listening)
