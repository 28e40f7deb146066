"""The floor plan: layers checked by import-linter, what each process imports, function length.

Layers (``[tool.importlinter]`` in pyproject.toml): the driver ``flywheel`` on top, the five services in
the middle and independent of each other, ``shared`` (contracts and helpers) at the bottom.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("rollout_service", "trainer_service", "verifier_service", "sandbox_service", "scheduler_service")
PACKAGES = ("flywheel", "shared", *SERVICES)
MAX_LINES = 80
"""Longest function outside tests/ unless its docstring says why (the words "longer than 80 lines")."""


def test_import_linter_contracts_are_kept():
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports;"
                        "sys.exit(lint_imports('pyproject.toml', no_cache=True, no_logo=True))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def _project_modules_after(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\n"
                        f"print('\\n'.join(m for m in sys.modules if m.split('.')[0] in {PACKAGES!r}))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return set(r.stdout.split())


def test_the_shared_config_imports_no_service_and_no_driver_module():
    loaded = _project_modules_after("import shared.config")
    assert loaded and all(m == "shared" or m.startswith("shared.") for m in loaded), sorted(loaded)


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_process_loads_only_its_own_package_and_shared(service):
    """``python -m <service>`` imports its ``main`` and ``config``: no other service's code, no driver code."""
    loaded = _project_modules_after(f"import {service}.main, {service}.config")
    foreign = {m for m in loaded if m.split(".")[0] not in (service, "shared")}
    assert not foreign, sorted(foreign)


def _long_functions() -> list[str]:
    found = []
    for pkg in (*PACKAGES, "benchmarks", "scripts"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_LINES and "longer than 80 lines" not in doc:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_outside_tests_is_longer_than_80_lines():
    assert _long_functions() == []
