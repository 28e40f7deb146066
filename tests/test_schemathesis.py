"""schemathesis (every check) against the scheduler's and the sandbox's OpenAPI documents, each served by a
real uvicorn on a free port: no server error, no response that breaks its documented schema, no
undocumented status code, and the bearer token honoured (``ignored_auth``).

Bounded: :data:`MAX_EXAMPLES` examples per operation, no shrinking, the scheduler without Kafka (REST only)
and the sandbox with its real worker pool. The whole module takes about a minute on two cores.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error, positive_data_acceptance
from schemathesis.config import SchemathesisConfig

from flywheel.broker import free_port
from flywheel.config import FlywheelConfig
from sandbox_service.api import create_app as create_sandbox
from sandbox_service.config import SandboxConfig
from scheduler_service.api import create_app as create_scheduler
from scheduler_service.registry import Registry
from scheduler_service.state import SchedulerState
from shared.auth import auth_headers
from shared.config import RunConfig

pytestmark = pytest.mark.e2e  # property-based runs of both OpenAPIs (about 2 minutes): the e2e tier

MAX_EXAMPLES = 25
"""Examples per operation (the generator's explicit and coverage cases come on top)."""
TOKEN = "schemathesis-test-token-0123456789"
STATS: Counter = Counter()
"""Requests sent and status codes seen, per API (printed at the end)."""


def _serve(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


def _stop(server, thread) -> None:
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def scheduler_url(tmp_path_factory):
    """The scheduler (REST only) with a registered train and eval task of domain ``toy``."""
    run_dir = tmp_path_factory.mktemp("schemathesis-scheduler")
    cfg = FlywheelConfig(run=RunConfig(dir=str(run_dir)), auth={"token": TOKEN})
    registry = Registry.from_url(cfg.scheduler.database_url, cfg.run)
    url, server, thread = _serve(create_scheduler(cfg, SchedulerState(cfg, registry, kafka=False)))
    tasks = [{"task_id": f"t{i}", "domain": "toy", "split": split, "prompt": [{"role": "user", "content": "say a"}],
              "verifier": {"kind": "regex", "pattern": "^a"}, "samples_per_task": 2}
             for i, split in enumerate(("train", "eval"))]
    r = httpx.post(f"{url}/v1/tasks", json={"tasks": tasks}, headers=auth_headers(TOKEN), timeout=30)
    assert r.status_code == 202, r.text
    try:
        yield url
    finally:
        _stop(server, thread)
        registry.close()
        print(f"\nschemathesis scheduler: {STATS['scheduler']} requests, statuses "
              f"{sorted((k[1], v) for k, v in STATS.items() if isinstance(k, tuple) and k[0] == 'scheduler')}")


@pytest.fixture(scope="module")
def sandbox_api_url():
    """The sandbox with its worker pool (degraded isolation allowed: the check is of the HTTP contract)."""
    url, server, thread = _serve(create_sandbox(SandboxConfig(max_concurrency=2, allow_degraded=True,
                                                              default_timeout_s=2.0), auth_token=TOKEN))
    try:
        yield url
    finally:
        _stop(server, thread)
        print(f"\nschemathesis sandbox: {STATS['sandbox']} requests, statuses "
              f"{sorted((k[1], v) for k, v in STATS.items() if isinstance(k, tuple) and k[0] == 'sandbox')}")


CONFIG = {"checks": {"positive_data_acceptance": {
    "expected-statuses": ["2xx", "3xx", "401", "403", "404", "409", "422", "429"]}}}
"""Every check with its defaults, except that a body the schema allows may get a 422: the APIs' semantic
checks cannot be written in JSON Schema (a reasoning-gym dataset the package does not know, a regex that does
not compile, a command that needs ``domain``, a domain level that does not exist, a record larger than the
broker's limit); each such 422 names the field."""


def _schema(url: str):
    return schemathesis.openapi.from_url(f"{url}/openapi.json", config=SchemathesisConfig.from_dict(CONFIG))


@pytest.fixture(scope="module")
def scheduler_schema(scheduler_url):
    return _schema(scheduler_url)


@pytest.fixture(scope="module")
def sandbox_schema(sandbox_api_url):
    return _schema(sandbox_api_url)


BOUNDED = settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=list(HealthCheck), derandomize=True, database=None)

scheduler = schemathesis.pytest.from_fixture("scheduler_schema")
sandbox = schemathesis.pytest.from_fixture("sandbox_schema")


NO_SAMPLER_503 = {"/v1/system/broker-restarted"}
"""Operations that answer a documented 503 in a scheduler without Kafka (no sampler runs there)."""


def _check(api: str, case) -> None:
    excluded = [not_a_server_error, positive_data_acceptance] if case.operation.path in NO_SAMPLER_503 else None
    response = case.call_and_validate(headers=auth_headers(TOKEN), timeout=60, excluded_checks=excluded)
    STATS[api] += 1
    STATS[(api, response.status_code)] += 1


@scheduler.parametrize()
@BOUNDED
def test_scheduler_api(case):
    """Every operation of the scheduler: 0 server errors, 0 schema violations (all checks)."""
    _check("scheduler", case)


@sandbox.parametrize()
@BOUNDED
def test_sandbox_api(case):
    """``POST /v1/execute``, ``/healthz``, ``/metrics`` of the sandbox (all checks)."""
    _check("sandbox", case)
