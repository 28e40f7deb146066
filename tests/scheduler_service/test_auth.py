"""Any local process could submit tasks, create eval rounds, resume a paused domain.
Every mutating route of the scheduler now needs the bearer token; reads stay open."""

from __future__ import annotations

import re

import httpx
from fastapi.routing import APIRoute

from scheduler_service.api import create_app
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared.auth import SCHEME_NAME, auth_headers, token_path

MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
PATH_VALUES = {"domain": "toy", "action": "pause", "round_id": "0", "task_id": "t0", "group_id": "g"}
"""Values for the path parameters of the routes (``action``: a value every action route accepts)."""


def _routes(app) -> list[tuple[str, str]]:
    """``(method, path)`` of every route of ``app`` in its OpenAPI document and its router (so a route added
    later cannot escape the check, whichever way it is mounted)."""
    out = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    stack = list(app.routes)
    while stack:
        r = stack.pop()
        if isinstance(r, APIRoute):
            out |= {(m, r.path_format) for m in r.methods}
        elif getattr(r, "original_router", None) is not None:  # an included router (FastAPI >= 0.16x)
            prefix = r.include_context.prefix if getattr(r, "include_context", None) else ""
            stack.extend(_Prefixed(prefix, x) for x in r.original_router.routes)
        elif isinstance(r, _Prefixed):
            if isinstance(r.route, APIRoute):
                out |= {(m, r.prefix + r.route.path_format) for m in r.route.methods}
    return sorted(out)


class _Prefixed:
    def __init__(self, prefix: str, route) -> None:
        self.prefix, self.route = prefix, route


def _url(path: str) -> str:
    url = re.sub(r"\{(\w+)(:path)?\}", lambda m: PATH_VALUES[m.group(1)], path)
    return url.replace("/v1/domains/toy/breaker/pause", "/v1/domains/toy/breaker/open")


async def test_every_mutating_route_needs_the_token_and_works_with_it(make_config, running, task):
    cfg = make_config()
    async with running(cfg, kafka=False) as (client, state):
        app = client._transport.app
        token = app.state.auth_token
        assert token and token_path(cfg.auth, cfg.run).read_text().strip() == token  # generated, 0600
        assert token_path(cfg.auth, cfg.run).stat().st_mode & 0o077 == 0
        routes = _routes(app)
        mutating = [(m, p) for m, p in routes if m in MUTATING]
        assert len(mutating) >= 10, mutating  # tasks, evals, 5 domain routes, control, training, system
        bare = httpx.AsyncClient(transport=client._transport, base_url="http://scheduler")
        for method, path in mutating:
            for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": token}):
                r = await bare.request(method, _url(path), json={}, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
        for method, path in routes:
            if method not in MUTATING and "{" not in path and path != "/metrics":
                assert (await bare.get(path)).status_code == 200, path  # reads stay open
        # with it: the requests are served (some are refused for what they say, none for who sent them)
        r = await client.post("/v1/tasks", json={"tasks": [task("t0", split="eval")]})
        assert r.status_code == 202, r.text
        assert (await client.post("/v1/evals", json={})).status_code == 202
        assert (await client.put("/v1/domains/toy", json={"weight": 2})).status_code == 200
        assert (await client.patch("/v1/domains/toy", json={"weight": 3})).status_code == 200
        assert (await client.post("/v1/domains/toy/pause")).status_code == 200
        assert (await client.post("/v1/domains/toy/resume")).status_code == 200
        assert (await client.post("/v1/domains/toy/breaker/open")).status_code == 200
        assert (await client.post("/v1/control", json={"command": "close_breaker", "domain": "toy"})).status_code == 200
        assert (await client.post("/v1/training/pause")).status_code == 200
        for method, path in mutating:
            r = await client.request(method, _url(path), json={})
            assert r.status_code != 401, (method, path, r.text)
        await bare.aclose()


def test_openapi_has_the_bearer_scheme_on_exactly_the_mutating_routes(make_config):
    cfg = make_config()
    registry = Registry.from_url(cfg.scheduler.database_url, cfg.run)
    try:
        doc = create_app(cfg, SchedulerState(cfg, registry, kafka=False)).openapi()
    finally:
        registry.close()
    scheme = doc["components"]["securitySchemes"][SCHEME_NAME]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            secured = op.get("security") == [{SCHEME_NAME: []}]
            assert secured == (method.upper() in MUTATING), (method, path)
            assert ("401" in op["responses"]) == secured, (method, path)


async def test_auth_required_false_turns_the_check_off(make_config, running, task):
    cfg = make_config()
    cfg.auth.required = False
    async with running(cfg, kafka=False) as (client, state):
        assert client._transport.app.state.auth_token is None
        bare = httpx.AsyncClient(transport=client._transport, base_url="http://scheduler")
        assert (await bare.post("/v1/tasks", json={"tasks": [task("open")]})).status_code == 202
        await bare.aclose()
    assert not token_path(cfg.auth, cfg.run).exists()
    assert auth_headers(None) == {}
