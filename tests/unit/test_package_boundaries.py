"""src/pdserve is the library the services and loadgen are built on: it never imports them (the cluster code is
handed factories by services/main.py instead; what loadgen and the planner share, such as the trace reader, lives
in pdserve)."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

SRC = Path(pdserve.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_module_under_src_pdserve_imports_services_or_loadgen():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20, SRC  # the package itself, not an empty folder
    offenders = {
        str(f.relative_to(SRC)): sorted(m for m in imported_modules(f) if m.split(".")[0] in ("services", "loadgen"))
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_the_check_sees_a_function_level_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from services.router.server import start_router\n")
    assert "services.router.server" in imported_modules(sample)
