"""The linter, the formatter and the type checker hold for the whole tree: CI runs `make test` alone, so a check
that lived only in `make lint` drifted (75 type errors had piled up unseen). Each test fails with the tool's own
report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON_TREES = ["src", "services", "loadgen", "tests", "scripts", "docs/experiments"]
TYPED_TREES = ["src", "services", "loadgen"]  # tests and experiments are checked by ruff alone


def run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command: list[str]):
    done = run([sys.executable, "-m", "ruff", *command, *PYTHON_TREES], timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_passes(tmp_path: Path):
    # A cache of its own: mypy's incremental mode misreads the generated protobuf package from a stale cache.
    args = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), *TYPED_TREES]
    done = run(args, timeout_s=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout  # checked files, not an empty run
