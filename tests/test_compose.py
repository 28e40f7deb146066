"""docker-compose.yml parses and wires every service the same way (needs the docker-compose binary, not a daemon)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
    assert env["KAFKA_ADVERTISED_LISTENERS"].split(",")[0] == "PLAINTEXT://kafka:9092"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert str(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == "1"
    assert "healthcheck" in kafka


def _published(svc: dict) -> list[tuple[str, int, int]]:
    """``(host_ip, published, target)`` of each published port, in either syntax ``docker-compose config`` prints."""
    out = []
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), int(p["published"]), int(p["target"])))
        else:
            parts = str(p).split("/")[0].split(":")
            host = parts[0] if len(parts) == 3 else ""
            out.append((host, int(parts[-2]), int(parts[-1])))
    return out


def test_sandbox_and_scheduler_specifics(compose):
    svcs = compose["services"]
    assert svcs["sandbox"]["privileged"] is True  # namespaces, mounts and cgroups for every run
    assert svcs["sandbox"]["environment"]["FLYWHEEL_SANDBOX__HOST"] == "0.0.0.0"
    assert ("127.0.0.1", 8000, 8000) in _published(svcs["scheduler"])


def test_only_what_a_user_needs_is_published_and_only_on_loopback(compose):
    published = {name: _published(svc) for name, svc in compose["services"].items() if svc.get("ports")}
    assert {name: sorted(p[1] for p in ports) for name, ports in published.items()} == {
        "scheduler": [8000], "kafka": [19092], "grafana": [3000], "jaeger": [16686], "prometheus": [9090]}
    for name, ports in published.items():
        assert all(host == "127.0.0.1" for host, _, _ in ports), (name, ports)


def test_gpu_profile(compose):
    svcs = compose["services"]
    assert svcs["sglang"]["profiles"] == ["gpu"]
    for name in SERVICES:
        assert "gpu" not in svcs[name].get("profiles", []), name


def test_observability_stack_is_in_the_default_profile_and_wired(compose):
    svcs = compose["services"]
    for name in ["otel-collector", "jaeger", "prometheus", "grafana", "job"]:
        assert not svcs[name].get("profiles"), name
    for name in SERVICES:
        env = svcs[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
        assert env["FLYWHEEL_TELEMETRY__TRACES"] == "otlp", name
    collector = yaml.safe_load((ROOT / "examples/compose/otel-collector.yaml").read_text())
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    # Prometheus scrapes each service where it serves /metrics
    prom = yaml.safe_load((ROOT / "examples/compose/prometheus.yml").read_text())
    targets = {}
    for job in prom["scrape_configs"]:
        for sc in job.get("static_configs", []):
            targets[job["job_name"]] = sc["targets"]
        for sd in job.get("dns_sd_configs", []):
            targets[job["job_name"]] = [f"{n}:{sd['port']}" for n in sd["names"]]
    port = str(svcs["trainer"]["environment"]["FLYWHEEL_TELEMETRY__METRICS_PORT"])
    assert targets == {"scheduler": ["scheduler:8000"], "sandbox": ["sandbox:8100"], "rollout": [f"rollout:{port}"],
                       "verifier": [f"verifier:{port}"], "trainer": [f"trainer:{port}"]}
    for name in ("rollout", "verifier", "trainer"):
        assert port in [str(p) for p in svcs[name]["expose"]], name
    mounts = [str(v.get("source") if isinstance(v, dict) else v.split(":")[0]) for v in svcs["grafana"]["volumes"]]
    assert any(m.endswith("examples/compose/grafana/dashboards") for m in mounts), mounts


def test_the_job_trains_against_the_running_scheduler(compose):
    job = compose["services"]["job"]
    cmd = job["command"]
    assert cmd[:2] == ["flywheel", "job"] and cmd[cmd.index("--url") + 1] == "http://scheduler:8000"
    assert (ROOT / cmd[2].removeprefix("/app/")).exists()
    assert job["restart"] == "no" and "scheduler" in job["depends_on"]


def test_the_image_installs_the_cpu_build_of_torch():
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#")]
    torch = next(i for i, ln in enumerate(lines) if "torch==" in ln and "pip install" in ln)
    assert "/whl/cpu" in lines[torch]
    assert torch < next(i for i, ln in enumerate(lines) if "pip install ." in ln)


def test_the_grafana_dashboard_is_what_its_script_writes():
    r = subprocess.run([sys.executable, str(ROOT / "scripts/grafana_dashboard.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    board = json.loads((ROOT / "examples/compose/grafana/dashboards/flywheel.json").read_text())
    assert board["uid"] == "flywheel" and len(board["panels"]) >= 10
    assert all(t["datasource"]["uid"] == "flywheel-prometheus" for p in board["panels"] for t in p["targets"])
    prov = yaml.safe_load((ROOT / "examples/compose/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert prov["datasources"][0]["uid"] == "flywheel-prometheus"
