"""The rollout's overhead per call of an environment's Python tool, beside calling the function directly.

    python benchmarks/env_tools.py [--calls 2000]

Times ``shared.envs.tools.call_tool`` (name lookup, argument check, injected ``state``, a worker thread for a
sync tool, the timeout, the result as text) on a trivial sync tool and a trivial async one, against the plain
function call measured in the same run. Target: <= 1 ms per call above the tool's own time. Prints the CPU, a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.envs.tools import call_tool  # noqa: E402
from shared.precision import cpu_features, cpu_model  # noqa: E402


def add(a: int, b: int, state: dict) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    state["n"] = state.get("n", 0) + 1
    return a + b


async def add_async(a: int, b: int, state: dict) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return add(a, b, state)


async def _through_loop(tool, calls: int) -> float:
    state: dict = {}
    t0 = time.perf_counter()
    for i in range(calls):
        out = await call_tool([tool], tool.__name__, {"a": i, "b": 1}, None, {"state": state}, 10.0)
        assert out == str(i + 1), out
    return (time.perf_counter() - t0) / calls


def main(calls: int) -> dict:
    state: dict = {}
    t0 = time.perf_counter()
    for i in range(calls):
        add(i, 1, state)
    direct = (time.perf_counter() - t0) / calls
    sync_call = asyncio.run(_through_loop(add, calls))
    async_call = asyncio.run(_through_loop(add_async, calls))
    return {"cpu": cpu_model(), "features": cpu_features(), "calls": calls,
            "direct_us": round(direct * 1e6, 2), "sync_tool_us": round(sync_call * 1e6, 1),
            "async_tool_us": round(async_call * 1e6, 1),
            "sync_overhead_ms": round((sync_call - direct) * 1e3, 4),
            "async_overhead_ms": round((async_call - direct) * 1e3, 4), "target_overhead_ms": 1.0}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    out = main(ap.parse_args().calls)
    print(f"CPU: {out['cpu']} ({out['features']})")
    print(f"direct call {out['direct_us']} us; through call_tool: sync {out['sync_tool_us']} us, "
          f"async {out['async_tool_us']} us (overhead {out['sync_overhead_ms']} / {out['async_overhead_ms']} ms)")
    print(json.dumps(out))
