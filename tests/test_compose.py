"""docker-compose.yml parses and wires every service the same way (needs the docker-compose binary, not a daemon)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ["sandbox", "scheduler", "rollout", "verifier", "trainer"]


@pytest.fixture(scope="module")
def compose() -> dict:
    """The fully resolved compose file, as ``docker-compose config`` prints it."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose binary not installed (apt-get install -y docker-compose)")
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_all_services_present(compose):
    names = set(compose["services"])
    for name in ["kafka", *SERVICES]:
        assert name in names, f"service {name} missing from docker-compose.yml"


def test_services_share_image_and_kafka(compose):
    svcs = compose["services"]
    builds = {name: str(svcs[name]["build"]) for name in SERVICES}
    assert len(set(builds.values())) == 1, builds
    assert Path(svcs["sandbox"]["build"]["context"]).resolve() == ROOT
    images = {svcs[name].get("image") for name in SERVICES}
    assert len(images) == 1, images
    for name in SERVICES:
        env = svcs[name]["environment"]
        assert env["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092", name
        assert env["FLYWHEEL_RUN__DIR"] == "/data", name
        assert env["FLYWHEEL_VERIFIER__SANDBOX_URL"] == "http://sandbox:8100", name
        assert env["FLYWHEEL_CONFIG"] == "/app/examples/arithmetic.yaml", name
        assert svcs[name]["depends_on"]["kafka"]["condition"] == "service_healthy", name
        assert svcs[name]["command"][-1] == f"{name}_service", name
        mounts = [(v.get("source"), v.get("target")) if isinstance(v, dict) else tuple(v.split(":")[:2])
                  for v in svcs[name].get("volumes", [])]
        assert ("flywheel-data", "/data") in mounts, (name, mounts)
    assert "flywheel-data" in compose["volumes"]


def test_kafka_is_single_node_kraft(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == "apache/kafka:3.9.0"
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://kafka:9092"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert str(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == "1"
    assert "healthcheck" in kafka


def test_sandbox_and_scheduler_specifics(compose):
    svcs = compose["services"]
    assert svcs["sandbox"]["privileged"] is True  # namespaces, mounts and cgroups for every run
    assert svcs["sandbox"]["environment"]["FLYWHEEL_SANDBOX__HOST"] == "0.0.0.0"
    ports = svcs["scheduler"]["ports"]
    assert any((isinstance(p, dict) and int(p.get("published", 0)) == 8000 and int(p["target"]) == 8000)
               or (isinstance(p, str) and p.endswith("8000:8000")) for p in ports), ports


def test_gpu_profile(compose):
    svcs = compose["services"]
    for name in ["sglang", "otel-collector"]:
        assert svcs[name]["profiles"] == ["gpu"], name
    for name in SERVICES:
        assert "gpu" not in svcs[name].get("profiles", []), name
        assert svcs[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
