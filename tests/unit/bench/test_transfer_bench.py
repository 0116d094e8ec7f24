"""The KV transfer bench (`pdserve bench transfer`, and `pdserve profile`'s transfer fit) on one small case: two real
processes over gloo on loopback, and a run that ends as cleanly as it measured (its receiver aborted at exit,
printing a C++ terminate line under the table)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ONE_CASE = """
from pdserve.bench.transfer_bench import default_cases, run_transfer_bench
rows = run_transfer_bench(cases=default_cases(tokens=16)[:1], repeats=1, warmup=0)["rows"]
print("measured", [row["name"] for row in rows])
"""


def test_a_run_measures_its_case_and_ends_without_an_abort_of_its_receiver() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    # A bound against a hang, not a timing: the run takes seconds.
    done = subprocess.run(
        [sys.executable, "-c", ONE_CASE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "measured ['SmolLM2 16 tok bf16']" in done.stdout
    assert "terminate called" not in done.stderr, done.stderr
