"""run.allocator: the torch services that ``flywheel`` starts run on tcmalloc, the others on the system's."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from flywheel.broker import free_port
from flywheel.launcher import TORCH_SERVICES, LocalSystem
from flywheel.service_env import allocator_env
from flywheel.supervision import RestartPolicy

MAPS = "import time; time.sleep(60)"


def test_allocator_env_follows_the_config_and_the_environment(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("run:\n  allocator: system\n")
    assert allocator_env(yaml, {}) == {}
    assert allocator_env(yaml, {"FLYWHEEL_RUN__ALLOCATOR": "tcmalloc"})["LD_PRELOAD"].startswith("libtcmalloc_minimal")
    yaml.write_text("model:\n  name: x\n")  # the default
    assert "tcmalloc_minimal" in allocator_env(yaml, {})["LD_PRELOAD"]
    assert allocator_env(yaml, {"FLYWHEEL_RUN__ALLOCATOR": "system"}) == {}
    assert allocator_env(tmp_path / "missing.yaml", {}) != {}  # no file: the default


def test_only_the_torch_services_get_the_preload_and_it_is_mapped(tmp_path: Path):
    """Real processes: a torch service started with the system's allocator environment has tcmalloc mapped; a
    service that does not run torch has not."""
    env = {"PATH": os.environ.get("PATH", ""), "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    (tmp_path / "logs").mkdir()
    dead = f"http://127.0.0.1:{free_port()}"
    sleeper = [sys.executable, "-c", MAPS]
    system = LocalSystem(tmp_path, env, None, dead, dead, policy=RestartPolicy(),
                         commands={"trainer": sleeper, "verifier": sleeper},
                         torch_env=allocator_env(tmp_path / "none.yaml", env))
    assert "trainer" in TORCH_SERVICES and "verifier" not in TORCH_SERVICES
    try:
        for name in ("trainer", "verifier"):
            system._spawn(name)
        time.sleep(0.5)
        maps = {n: Path(f"/proc/{sp.process.pid}/maps").read_text() for n, sp in system.services.items()}
        assert "libtcmalloc_minimal" in maps["trainer"]
        assert "libtcmalloc_minimal" not in maps["verifier"]
    finally:
        for sp in system.services.values():
            sp.process.kill()
            sp.process.wait()
