"""The Grafana dashboard of docker-compose.yml references only metric names a running system serves."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _dashboard_module():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "scripts/grafana_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _served(urls: dict[str, str]) -> set[str]:
    """Every sample name (``_total``, ``_bucket``... as exposed) and family name the services serve now."""
    names = set()
    for url in urls.values():
        for fam in text_string_to_metric_families(httpx.get(url, timeout=30).text):
            names.add(fam.name)
            if fam.type == "counter":
                names.add(fam.name + "_total")
            elif fam.type == "histogram":
                names.update(fam.name + s for s in ("_bucket", "_sum", "_count"))
            names.update(s.name for s in fam.samples)
    return names


def test_every_metric_the_grafana_dashboard_uses_is_served(observed):
    mod = _dashboard_module()
    used = mod.metric_names()
    board_text = (ROOT / "examples/compose/grafana/dashboards/flywheel.json").read_text()
    assert used == set(re.findall(r"\bflywheel_[a-z0-9_]+", board_text)) - {"flywheel"}
    served = _served(observed.system.metrics_urls)
    assert len(used) >= 20
    missing = sorted(n for n in used if n not in served)
    assert not missing, f"the dashboard uses metric names no service serves: {missing}"
    # and each used family is a flywheel_<area>_ name of one of the five services
    areas = {n.split("_")[1] for n in used}
    assert areas == {"scheduler", "rollout", "verifier", "trainer", "sandbox"}, areas
