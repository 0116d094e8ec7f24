"""Ctrl-C mid-run: loadgen stops sending, cancels what is in flight, keeps every rate run (the cut one marked),
plots those that finished and exits 130 with one line, not a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.client import Client, RunInterrupted
from loadgen.outcome import interrupted_line
from loadgen.record import CANCELLED, OK
from loadgen.workload import Request
from tests.unit.loadgen.interruptible import HOLDING, HoldingBackend

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(60)  # a run that is never cancelled hangs: fail it, not the whole suite
PLOTS = ["goodput.png", "slo_attainment.png", "tpot_cdf.png", "ttft_cdf.png"]


async def test_a_cancelled_run_sends_no_more_and_returns_what_it_sent_the_in_flight_cancelled():
    backend = HoldingBackend(hold_in=1, to_hold=2)
    requests = [Request([1], 2, 0.0), Request([1], 2, 0.0), Request([1], 2, 0.0), Request([1], 2, 3600.0)]
    run = asyncio.create_task(Client(backend).run(requests))
    await backend.all_held.wait()  # the first of the three due now answered, the other two in flight
    run.cancel()
    with pytest.raises(RunInterrupted) as interrupted:
        await run
    records = interrupted.value.records
    assert [r.status for r in records] == [OK, CANCELLED, CANCELLED]  # the one due in an hour never went
    assert all(r.error_s is not None for r in records[1:])


@pytest.mark.parametrize("rates", ["1000,2000", "2000"])
def test_ctrl_c_mid_run_keeps_the_finished_rates_and_the_cut_one_marked_plots_the_finished_and_exits_130(
    tmp_path, rates
):
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    flags = ["--addr", "127.0.0.1:1", "--model", "tiny-random", "--num-prompts", "3", "--request-rate", rates]
    flags += ["--goodput", "ttft:150", "--result-json", str(out), "--plot-dir", str(plots)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.loadgen.interruptible", *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As a terminal's Ctrl-C finds it: a suite started in the background (`cmd &` in a script) hands its
        # children SIGINT ignored, and Python then installs no handler of its own for it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the last rate's last two requests are held open
        if line.strip() == HOLDING:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # a guard against a hang, not a timing
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    finished = rates.count(",")
    (line,) = [line for line in err.splitlines() if "interrupted" in line]
    assert line == (
        f"loadgen: interrupted during the run at request_rate 2000.0 (3 sent, those in flight cancelled): {finished} "
        f"finished rate(s) and the interrupted one, marked interrupted: true, in {out}"
    )
    data = json.loads(out.read_text())
    runs = data.get("runs", [data])
    assert [run["interrupted"] for run in runs] == [False] * finished + [True]
    assert [r["status"] for r in runs[-1]["requests"]] == [OK, CANCELLED, CANCELLED]
    if finished:
        assert runs[0]["completed"] == 3
        assert data["distserve_goodput"]["request_rate"] == 1000.0  # the cut rate counts for none
        assert sorted(p.name for p in plots.iterdir()) == PLOTS
    else:
        assert not plots.exists()  # nothing finished to plot


def test_ctrl_c_before_any_rate_or_between_rates_says_so():
    finished = {"interrupted": False, "request_rate": 1.0, "requests": []}
    assert interrupted_line([], None) == "interrupted before the first rate: nothing measured"
    assert interrupted_line([finished], None) == (
        "interrupted between rates: 1 finished rate(s) not written (no --result-json)"
    )
