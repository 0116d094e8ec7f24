"""Only src/pdserve/env.py reads or writes this process's environment (docs/architecture.md): what a process reads
from it is then listed in one place, each variable with why, and a test that sets one knows where it is read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("src", "services", "loadgen")
ALLOWED = ROOT / "src" / "pdserve" / "env.py"
ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}  # os's ways in


def environment_uses(path: Path) -> list[str]:
    """`os.environ` and its kind, and `from os import environ`, with their lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"line {node.lineno}: from os import {a.name}" for a in node.names if a.name in ENVIRONMENT]
    return found


def test_no_module_but_env_py_touches_the_environment():
    files = [f for tree in TREES for f in sorted((ROOT / tree).rglob("*.py")) if f != ALLOWED]
    assert len(files) > 100, ROOT  # the trees themselves, not empty folders
    offenders = {str(f.relative_to(ROOT)): uses for f in files if (uses := environment_uses(f))}
    assert offenders == {}


@pytest.mark.parametrize(
    "source",
    [
        "import os\nx = os.environ.get('A')\n",
        "import os\ndef f():\n    os.environ['A'] = '1'\n",
        "import os\nx = {**os.environ}\n",
        "import os\nx = os.getenv('A')\n",
        "from os import environ\n",
    ],
)
def test_the_check_sees_each_way_in(tmp_path, source):
    sample = tmp_path / "sample.py"
    sample.write_text(source)
    assert environment_uses(sample)
