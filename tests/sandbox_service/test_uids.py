"""Slot uids claimed per sandbox service: two services on one host never run programs as the same uid."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from sandbox_service.uids import LOCK_DIRS, UidClaim


@pytest.fixture
def base():
    """A uid range far from any real sandbox's; its lock files are removed afterwards."""
    b = random.randrange(10**6, 2**31 - 10**5)
    yield b
    for d in LOCK_DIRS:
        for uid in range(b, b + 10):
            (d / f"uid-{uid}.lock").unlink(missing_ok=True)


def test_a_second_service_takes_the_next_free_uids_and_gets_them_back_when_the_first_lets_go(base):
    first = UidClaim(base, 3)
    try:
        second = UidClaim(base, 2)
        try:
            assert first.uids == [base, base + 1, base + 2] and second.uids == [base + 3, base + 4]
        finally:
            second.release()
        first.release()
        again = UidClaim(base, 4)
        assert again.uids == [base, base + 1, base + 2, base + 3]
        again.release()
    finally:
        first.release()


def test_a_killed_service_leaves_its_uids_free(base):
    """The lock goes with the process, ``kill -9`` included: a crashed sandbox never strands its uids."""
    code = f"from sandbox_service.uids import LOCK_DIRS, UidClaim\nc = UidClaim({base}, 2)\nprint(c.uids, flush=True)\n" \
           "import time\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"[{base}, {base + 1}]"
        held = UidClaim(base, 1)
        assert held.uids == [base + 2]  # the live one holds its two
        held.release()
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while (c := UidClaim(base, 1)).uids != [base] and time.monotonic() < deadline:
            c.release()
            time.sleep(0.05)
        assert c.uids == [base]
        c.release()
    finally:
        proc.kill()
        proc.wait(10)


def test_too_few_free_uids_is_a_clear_error(base, monkeypatch):
    monkeypatch.setattr("sandbox_service.uids.SEARCH", 3)
    held = UidClaim(base, 2)
    try:
        with pytest.raises(RuntimeError, match=r"only 1 of 2 slot uids .* are free of other sandbox services"):
            UidClaim(base, 2)
    finally:
        held.release()
