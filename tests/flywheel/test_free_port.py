"""``flywheel.broker.free_port``: ports a server binds later, drawn where outgoing connections never land."""

from __future__ import annotations

import socket

from flywheel.broker import FREE_PORT_MIN, ephemeral_port_range, free_port, port_is_free


def test_free_ports_lie_below_the_ephemeral_range_are_bindable_and_never_repeat():
    low, high = ephemeral_port_range()
    assert 1024 <= low <= high <= 65535
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(FREE_PORT_MIN <= p < low for p in ports), [p for p in ports if not FREE_PORT_MIN <= p < low]
    assert all(port_is_free(p) for p in ports[:20])


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
