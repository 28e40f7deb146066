"""The shared Prometheus helpers: the domain-label cap, the metrics server, parsing an exposition."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client import Counter, Histogram

from flywheel.broker import free_port
from shared.config import TelemetryConfig
from shared.metrics import (CONTENT_TYPE_PLAIN, MAX_DOMAINS, NO_DOMAIN, OTHER, DomainLabels, families,
                            parse, process_registry, render, scrape, serve_metrics, total)


def test_the_domain_cap_holds_for_300_names_and_keeps_the_first_ones():
    assert MAX_DOMAINS == 128  # the documented default cap
    labels = DomainLabels(cap=MAX_DOMAINS)
    names = [f"d{i:03d}" for i in range(300)]
    got = [labels(n) for n in names]
    assert got[:128] == names[:128]
    assert set(got[128:]) == {OTHER}
    assert len(set(got)) == 128 + 1
    assert labels("d005") == "d005" and labels("d200") == OTHER  # stable after the cap is reached
    assert labels(None) == NO_DOMAIN and labels("") == NO_DOMAIN
    with pytest.raises(ValueError):
        DomainLabels(-1)


def test_the_cap_holds_in_a_labelled_family_under_concurrent_first_sightings():
    labels = DomainLabels(cap=10)
    registry = process_registry()
    c = Counter("flywheel_test_samples", "test", ["domain"], registry=registry)

    def work(k: int) -> None:
        for i in range(300):
            c.labels(labels(f"d{(i * 7 + k) % 300}")).inc()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = parse(render(registry)[0].decode())
    values = {lab["domain"] for lab, _ in samples["flywheel_test_samples_total"]}
    assert len(values) <= 10 + 1 and OTHER in values
    assert total(samples, "flywheel_test_samples_total") == 8 * 300


def test_the_server_serves_the_registry_and_stays_off_without_a_port():
    registry = process_registry()
    Histogram("flywheel_test_call_seconds", "test", ["kind"], registry=registry).labels("regex").observe(0.2)
    assert serve_metrics(TelemetryConfig(metrics_port=0), registry) is None
    assert serve_metrics(TelemetryConfig(metrics=False, metrics_port=free_port()), registry) is None
    server = serve_metrics(TelemetryConfig(metrics_port=free_port()), registry)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        r = httpx.get(url, timeout=5)
        assert r.status_code == 200
        got = scrape(url)
        assert got["flywheel_test_call_seconds_count"] == [({"kind": "regex"}, 1.0)]
        assert total(got, "flywheel_test_call_seconds_bucket", lambda lab: lab["le"] == "0.25") == 1.0
        assert got["process_cpu_seconds_total"][0][1] > 0
        assert families(r.text)["flywheel_test_call_seconds"] == "histogram"
        body, content_type = render(registry)  # what the scheduler and the sandbox answer: the same format
        assert content_type == r.headers["content-type"] == CONTENT_TYPE_PLAIN
        assert "flywheel_test_call_seconds_count" in parse(body.decode())
        _, om = render(registry, "application/openmetrics-text; version=1.0.0")
        assert om.startswith("application/openmetrics-text")
    finally:
        server.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=2)
