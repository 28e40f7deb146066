"""The documentation site (``mkdocs.yml``, Material theme) builds with ``--strict`` (a broken link or a page
missing from the navigation fails it), every page under ``docs/`` is in the navigation, and the generated
reference pages (``scripts/gen_reference.py``) match the code they describe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _nav_pages(nav) -> set[str]:
    out: set[str] = set()
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out |= _nav_pages(value) if isinstance(value, list) else {value}
    return out


def test_every_page_is_in_the_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == _nav_pages(nav), (sorted(pages - _nav_pages(nav)), sorted(_nav_pages(nav) - pages))


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "guides" / "lora" / "index.html").is_file()


def test_the_generated_reference_is_up_to_date():
    """The CLI, configuration and REST pages are regenerated from the typer app, the pydantic settings and the
    OpenAPI schemas; a changed option, field or route without ``python scripts/gen_reference.py`` fails here."""
    r = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_the_reference_names_every_command_section_and_route():
    """The pages are not empty shells: every top-level command, config section and scheduler route is there."""
    import typer

    from flywheel.cli import app
    from flywheel.config import FlywheelConfig

    ref = ROOT / "docs" / "reference"
    cli, config, rest = ((ref / f).read_text() for f in ("cli.md", "config.md", "rest.md"))
    assert all(f"## `flywheel {c}`" in cli for c in typer.main.get_command(app).commands)
    assert all(f"`{s}" in config for s in FlywheelConfig.model_fields)
    assert "### `POST /v1/tasks`" in rest and "### `POST /v1/execute`" in rest
