"""loadgen's exit status and the time each failed request took to fail, on hand-made runs and a scripted server."""

from __future__ import annotations

import pytest

from loadgen import benchmark
from loadgen.__main__ import main
from loadgen.benchmark import BenchmarkConfig, build_result
from loadgen.client import Client
from loadgen.outcome import failed_runs
from loadgen.record import OK, REJECTED, RequestRecord
from loadgen.report import comparison_table, summary_table
from loadgen.workload import Request, WorkloadConfig
from tests.unit.loadgen.scripted import ScriptedBackend

CONFIG = BenchmarkConfig("127.0.0.1:1", WorkloadConfig())


def run(*statuses: str) -> dict:
    records = [RequestRecord(f"r{i}", 4, 1, 0.0, status=s) for i, s in enumerate(statuses)]
    for r in records:
        if r.completed:
            r.message_times_s, r.message_tokens = [0.1], [1]
    return build_result(CONFIG, 1.0, records, 1.0)


def test_a_run_fails_when_nothing_completed_or_anything_failed_but_a_shed():
    assert failed_runs([run(OK, REJECTED, REJECTED)]) == []
    (line,) = failed_runs([run(OK, REJECTED), run(OK, "UNAVAILABLE", "UNAVAILABLE", REJECTED)])
    assert line == "the run at request_rate 1.0 failed 2 requests (UNAVAILABLE: 2)"
    (line,) = failed_runs([run(REJECTED, REJECTED)])
    assert line == "the run at request_rate 1.0 completed no request (RESOURCE_EXHAUSTED: 2)"


@pytest.mark.parametrize(("statuses", "code"), [((OK, REJECTED), 0), ((OK, "UNAVAILABLE"), 1), ((REJECTED,), 1)])
def test_the_exit_status_says_whether_the_run_can_be_published(tmp_path, capsys, monkeypatch, statuses, code):
    """47 of 60 requests UNAVAILABLE (the server gone mid-run) exited 0."""
    monkeypatch.setattr(benchmark, "run_benchmark", lambda config, console, on_result: on_result([run(*statuses)]))
    argv = ["--addr", "127.0.0.1:1", "--model", "tiny-random", "--result-json", str(tmp_path / "r.json")]
    assert main(argv) == code
    assert ("loadgen: the run at request_rate 1.0" in capsys.readouterr().err) == bool(code)


async def test_each_request_that_did_not_complete_records_its_time_to_fail():
    records, _ = await Client(ScriptedBackend([])).run([Request([5], 1)])
    assert records[0].status == "EMPTY_STREAM" and records[0].error_s is not None and records[0].error_s >= 0
    records, _ = await Client(ScriptedBackend([(0.1, 1)])).run([Request([5], 1)])
    assert records[0].status == OK and records[0].error_s is None


def test_the_summary_says_its_latencies_are_over_the_completed_requests():
    table = summary_table(run(OK, REJECTED, "UNAVAILABLE"))
    labels, values = table.columns[0]._cells, table.columns[1]._cells
    assert values[labels.index("Latencies below: completed requests only")] == "1 of 3"
    assert values[labels.index("Mean TTFT (ms)")] == "100.00"
    nothing = summary_table(run(REJECTED))
    assert nothing.columns[1]._cells[nothing.columns[0]._cells.index("Mean TTFT (ms)")] == "n/a"


@pytest.mark.parametrize("old_zero", [False, True])
def test_compare_shows_no_ratio_for_a_run_that_completed_nothing(old_zero):
    """A file of vLLM's, or of loadgen's before null, has 0 ms there: TTFT read 0.00x, infinitely better."""
    a, b = run(OK), run(REJECTED)
    if old_zero:
        b["mean_ttft_ms"] = 0.0
    table = comparison_table(a, b, "A", "B")
    row = table.columns[0]._cells.index("Mean TTFT (ms)")
    assert [column._cells[row] for column in table.columns[1:]] == ["100.00", "n/a", "-"]
