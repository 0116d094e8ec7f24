"""A whole `loadgen` sweep through the CLI against the scripted server: what it prints and writes at its end."""

from __future__ import annotations

import json

import pytest

from loadgen import benchmark
from loadgen.__main__ import main
from tests.unit.loadgen.scripted import ScriptedBackend

SWEEP = ["--addr", "127.0.0.1:1", "--model", "tiny-random", "--num-prompts", "2", "--request-rate", "500,1000"]


@pytest.mark.parametrize(("ttft_bound", "says"), [("150", "1000 req/s"), ("50", "none met")])
def test_a_sweep_with_slos_prints_and_writes_its_distserve_goodput(tmp_path, capsys, monkeypatch, ttft_bound, says):
    monkeypatch.setenv("COLUMNS", "200")  # the line unwrapped
    monkeypatch.setattr(benchmark, "make_backend", lambda config: ScriptedBackend([(0.1, 1), (0.2, 1)]))  # TTFT 100
    out = tmp_path / "sweep.json"
    assert main([*SWEEP, "--goodput", f"ttft:{ttft_bound}", "--warmup-requests", "3", "--result-json", str(out)]) == 0
    assert f"DistServe goodput (highest rate with SLO attainment >= 0.9): {says}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["warmup_requests"], r["warmup_completed"], r["completed"]) for r in data["runs"]] == [(3, 3, 2)] * 2
    distserve = data["distserve_goodput"]
    assert distserve["request_rate"] == (1000.0 if ttft_bound == "150" else None)
