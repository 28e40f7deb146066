"""aiokafka's repeated lines are rate-limited in every service's log: a minute of a broker outage (thousands of
"Unable connect" errors) writes a handful of lines per kind, the first line after a suppression counts what was
dropped, and other loggers pass untouched."""

from __future__ import annotations

import logging

from shared.telemetry import RateLimitFilter


class _Lines(logging.Handler):
    def __init__(self, f: RateLimitFilter) -> None:
        super().__init__()
        self.addFilter(f)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.getMessage()}")


def test_a_minute_of_outage_writes_a_few_lines_per_kind_on_every_handler():
    t = [0.0]
    f = RateLimitFilter(burst=5, window_s=60.0, clock=lambda: t[0])
    a, b = _Lines(f), _Lines(f)  # stderr and the log file share one filter: each sees the same lines
    conn, coord = logging.getLogger("aiokafka.conn"), logging.getLogger("aiokafka.consumer.group_coordinator")
    mine = logging.getLogger("trainer")
    for lg in (conn, coord, mine):
        lg.addHandler(a)
        lg.addHandler(b)
        lg.propagate = False
    try:
        for i in range(3800):  # one outage minute, as measured in a trainer's log
            t[0] = i * 60.0 / 3800
            conn.error("Unable connect to node with id %s: %s", 1, "refused")
            if i % 10 == 0:
                coord.error("Error sending %s to node %s", "HeartbeatRequest", 1)
        mine.warning("the broker is away")
        assert a.lines == b.lines
        assert sum(line.startswith("aiokafka.conn") for line in a.lines) == 5
        assert sum(line.startswith("aiokafka.consumer") for line in a.lines) == 5
        assert "trainer the broker is away" in a.lines  # not aiokafka: untouched
        t[0] = 61.0  # the next minute: the first line says how many were dropped
        conn.error("Unable connect to node with id %s: %s", 1, "refused")
        assert a.lines[-1].endswith("[3795 more like this suppressed]"), a.lines[-1]
        assert "Unable connect to node with id 1: refused" in a.lines[-1]
    finally:
        for lg in (conn, coord, mine):
            lg.removeHandler(a)
            lg.removeHandler(b)
            lg.propagate = True
