"""The floor plan: layers checked by import-linter, what each process imports, function length.

Layers (``[tool.importlinter]`` in pyproject.toml): the driver ``flywheel`` on top, the five services in
the middle and independent of each other, ``shared`` (contracts and helpers) at the bottom.
"""

from __future__ import annotations

import ast
import functools
import re
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


def _probe(code: str) -> subprocess.Popen:
    """A fresh interpreter that runs ``code`` and prints the project modules it then holds."""
    return subprocess.Popen([sys.executable, "-c", f"{code}\nimport sys\n"
                             f"print('\\n'.join(m for m in sys.modules if m.split('.')[0] in {PACKAGES!r}))"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@functools.lru_cache(maxsize=1)
def _imports_of_each_process() -> dict[str, tuple[int, set[str], str]]:
    """``{what: (exit code, project modules loaded, stderr)}`` for ``shared.config`` and each service's entry
    modules, the interpreters run side by side (each import is seconds of CPU)."""
    codes = {"shared": "import shared.config", **{s: f"import {s}.main, {s}.config" for s in SERVICES}}
    procs = {what: _probe(code) for what, code in codes.items()}
    found = {}
    for what, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        found[what] = (proc.returncode, set(out.split()), err[-3000:])
    return found


def _project_modules_after(what: str) -> set[str]:
    code, loaded, err = _imports_of_each_process()[what]
    assert code == 0, err
    return loaded


def test_the_shared_config_imports_no_service_and_no_driver_module():
    loaded = _project_modules_after("shared")
    assert loaded and all(m == "shared" or m.startswith("shared.") for m in loaded), sorted(loaded)


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_process_loads_only_its_own_package_and_shared(service):
    """``python -m <service>`` imports its ``main`` and ``config``: no other service's code, no driver code."""
    loaded = _project_modules_after(service)
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


MAX_MODULE_LINES = 600
"""Longest product module: past this a module holds more than one responsibility (split it along them)."""


def _python_files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_product_module_is_longer_than_600_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _python_files(*PACKAGES)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []


def test_code_and_comments_name_no_issue_numbers():
    """Code says what it does and why; which issue or round brought it belongs in the changelog."""
    pattern = re.compile(r"\b[Ii]ssues? #?\d+")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
             for p in _python_files(*PACKAGES, "benchmarks", "scripts", "examples", "tests")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (function-level imports included)."""
    out: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            out |= {m for m in (base, *(f"{base}.{a.name}" for a in node.names)) if m in known}
    return out - {name}


def test_no_two_modules_import_each_other():
    """A circle between two files means neither can be read (or loaded) without the other; a metrics module,
    for one, defines and registers its metrics and is fed by its service, never the other way round."""
    files = {_module_name(p): p for p in _python_files(*PACKAGES)}
    graph = {name: _imports(path, name, set(files)) for name, path in files.items()}
    circles = sorted(f"{a} <-> {b}" for a, deps in graph.items() for b in deps if a < b and a in graph[b])
    assert circles == []
