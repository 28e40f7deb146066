"""docker-compose.yml parses and wires every service the same way (needs the docker-compose binary, not a daemon)."""

from __future__ import annotations

import json
import os
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


# ---------------------------------------------------------------- access control in compose
FLYWHEEL_CONTAINERS = [*SERVICES, "rollout-long", "job"]
TOKEN_FILE = "/data/auth_token"


def _compose_config(*files: str) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose binary not installed (apt-get install -y docker-compose)")
    args = [a for f in files for a in ("-f", str(ROOT / f))]
    out = subprocess.run([exe, *args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.fixture(scope="module")
def sasl() -> dict:
    """docker-compose.yml with examples/compose/kafka-sasl.yml on top, resolved."""
    return _compose_config("docker-compose.yml", "examples/compose/kafka-sasl.yml")


def test_every_flywheel_container_reads_the_one_token_file_written_before_it_starts(compose):
    svcs = compose["services"]
    init = svcs["auth-token"]
    assert "ensure_token_file" in " ".join(init["command"]) and repr(TOKEN_FILE) in " ".join(init["command"])
    assert init["restart"] == "no" and not init.get("ports")
    for name in FLYWHEEL_CONTAINERS:
        env = svcs[name]["environment"]
        assert env["FLYWHEEL_AUTH__TOKEN_FILE"] == TOKEN_FILE, name  # the verifier and rollout need it too
        assert "FLYWHEEL_AUTH__TOKEN" not in env, name  # never in the environment
        assert svcs[name]["depends_on"]["auth-token"]["condition"] == "service_completed_successfully", name
        mounts = [(v.get("source"), v.get("target")) if isinstance(v, dict) else tuple(v.split(":")[:2])
                  for v in svcs[name].get("volumes", [])]
        assert ("flywheel-data", "/data") in mounts, (name, mounts)
    assert env["FLYWHEEL_RUN__DIR"] == os.path.dirname(TOKEN_FILE)  # the embedded mode's <run dir>/auth_token


def test_nothing_is_published_beyond_loopback_with_or_without_the_sasl_override(compose, sasl):
    for cfg in (compose, sasl):
        for name, svc in cfg["services"].items():
            for host, published, _ in _published(svc):
                assert host == "127.0.0.1", (name, published)
    assert ("127.0.0.1", 8000, 8000) in _published(compose["services"]["scheduler"])


def test_the_sasl_override_names_existing_kafka_fields_and_closes_the_open_listener(sasl):
    from shared.config import KafkaConfig

    svcs = sasl["services"]
    kafka = svcs["kafka"]["environment"]
    protocols = dict(p.split(":") for p in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    clients = [ln.split("://")[0] for ln in kafka["KAFKA_ADVERTISED_LISTENERS"].split(",")]
    assert clients and all(protocols[ln] == "SASL_PLAINTEXT" for ln in clients), protocols
    assert "PLAINTEXT://" not in kafka["KAFKA_LISTENERS"].replace("SASL_PLAINTEXT://", "")
    assert kafka["KAFKA_SASL_ENABLED_MECHANISMS"] == "PLAIN"
    assert "/run/secrets/kafka_server_jaas.conf" in kafka["KAFKA_OPTS"]
    assert "--command-config /run/secrets/kafka_admin.properties" in svcs["kafka"]["healthcheck"]["test"][-1]
    for name in ["scheduler", "rollout", "rollout-long", "verifier", "trainer"]:
        env = svcs[name]["environment"]
        fields = {k.removeprefix("FLYWHEEL_KAFKA__").lower(): v for k, v in env.items()
                  if k.startswith("FLYWHEEL_KAFKA__")}
        assert set(fields) <= set(KafkaConfig.model_fields), (name, set(fields) - set(KafkaConfig.model_fields))
        cfg = KafkaConfig(**fields)  # the values validate
        assert (cfg.security_protocol, cfg.sasl_mechanism) == ("SASL_PLAINTEXT", "PLAIN"), name
        assert cfg.sasl_plain_password is None and "FLYWHEEL_KAFKA__SASL_PLAIN_PASSWORD" not in env, name
        assert [s["source"] for s in svcs[name]["secrets"]] == ["kafka_password"], name
        assert cfg.sasl_plain_password_file == "/run/secrets/kafka_password", name
    for name in ["sandbox", "job"]:  # untrusted code / REST only: no broker password
        assert not svcs[name].get("secrets") and "FLYWHEEL_KAFKA__SECURITY_PROTOCOL" not in svcs[name]["environment"]
    for secret in sasl["secrets"].values():  # the operator's, outside the committed tree
        assert Path(secret["file"]).parent == ROOT / ".secrets", secret
    jaas = (ROOT / "examples/compose/kafka_server_jaas.conf.in").read_text()
    user = svcs["trainer"]["environment"]["FLYWHEEL_KAFKA__SASL_PLAIN_USERNAME"]
    assert f'user_{user}="@FLYWHEEL_PASSWORD@"' in jaas and "PlainLoginModule required" in jaas
    assert "@ADMIN_PASSWORD@" in (ROOT / "examples/compose/kafka_admin.properties.in").read_text()


def test_security_doc_covers_what_issue_19_asks():
    doc = (ROOT / "docs/security.md").read_text()
    for needle in ["Threat model", "auth_token", "FLYWHEEL_AUTH__TOKEN_FILE", "Rotation", "0700", "0600",
                   "environment", "Tansu", "RewardEvent", "SASL_PLAINTEXT", "examples/compose/kafka-sasl.yml",
                   "ACL", "mTLS"]:
        assert needle in doc, needle
