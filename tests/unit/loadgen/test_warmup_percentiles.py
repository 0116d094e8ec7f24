"""--warmup-requests: sent and awaited before the run, in no figure, counted in the JSON; --metric-percentiles:
the latency percentiles reported, vLLM's flag, today's p90/p99 by default."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from loadgen.__main__ import main
from loadgen.benchmark import BenchmarkConfig, build_result, warmup_requests
from loadgen.client import Client, Send
from loadgen.record import RequestRecord
from loadgen.report import summary_table
from loadgen.workload import Request, WorkloadConfig
from tests.unit.loadgen.test_goodput_metrics import stream

WARMUP_PROMPT = [9]


class LoggingBackend:
    """Answers each request with one token after yielding once; logs when each was sent and answered."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bool]] = []  # (event, a warm-up request)

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncIterator[Send]:
        async def send(req: Request, record: RequestRecord) -> None:
            warmup = req.prompt_token_ids == WARMUP_PROMPT
            self.log.append(("sent", warmup))
            await asyncio.sleep(0)
            record.message_times_s, record.message_tokens = [0.1], [1]
            self.log.append(("answered", warmup))

        yield send


async def test_the_warmup_is_answered_before_the_run_sends_and_is_not_among_its_records():
    backend, warmed = LoggingBackend(), []
    measured = [Request([1, 2], 1, 0.0) for _ in range(3)]
    warmup = [Request(WARMUP_PROMPT, 1, 5.0) for _ in range(2)]  # sent at once whatever their arrival
    records, _ = await Client(backend).run(measured, warmup=warmup, on_warmup=warmed.extend)
    assert len(records) == 3 and len(warmed) == 2
    first_measured = backend.log.index(("sent", False))
    assert backend.log[:first_measured] == [("sent", True)] * 2 + [("answered", True)] * 2
    assert all(r.start_s < 1.0 for r in warmed)


def test_the_warmup_is_counted_apart_in_the_json_and_in_no_figure():
    config = BenchmarkConfig("x:1", WorkloadConfig(num_prompts=4), warmup_requests=2)
    assert len(warmup_requests(config, 0)) == 2 and warmup_requests(BenchmarkConfig("x:1", WorkloadConfig()), 0) == []
    warmed = [stream([5.0], [1]), stream([], [], status="UNAVAILABLE")]  # a slow one and a failure
    run = build_result(config, 1.0, [stream([0.1, 0.2], [1, 1])], 1.0, warmed)
    assert (run["warmup_requests"], run["warmup_completed"], run["warmup_failed_by_code"]) == (2, 1, {"UNAVAILABLE": 1})
    assert (run["completed"], run["failed"], run["num_prompts"]) == (1, 0, 1)
    assert run["mean_ttft_ms"] == pytest.approx(100.0)  # the warm-up's 5 s TTFT is in no figure


def test_metric_percentiles_add_the_keys_asked_and_default_to_p90_p99():
    records = [stream([0.1 * (i + 1), 0.1 * (i + 1) + 0.05], [1, 1]) for i in range(10)]
    default = build_result(BenchmarkConfig("x:1", WorkloadConfig()), 1.0, records, 1.0)
    assert {"p90_ttft_ms", "p99_ttft_ms"} <= default.keys() and "p50_ttft_ms" not in default
    asked = build_result(BenchmarkConfig("x:1", WorkloadConfig(), metric_percentiles=(50, 99.9)), 1.0, records, 1.0)
    assert asked["p50_ttft_ms"] == pytest.approx(550.0) and "p99.9_e2el_ms" in asked and "p90_ttft_ms" not in asked
    assert asked["metric_percentiles"] == [50, 99.9]
    rows = summary_table(asked).columns[0]._cells
    assert "P50 TTFT (ms)" in rows and "P99.9 ITL per token (ms)" in rows and "P90 TTFT (ms)" not in rows


def test_a_percentile_of_many_digits_keeps_its_own_key_as_vllm_names_it():
    """`p{:g}` rounded to six digits: 99.99999 was written as p100, the key of the maximum, and overwritten by it."""
    records = [stream([0.001 * (i + 1), 0.001 * (i + 1) + 0.05], [1, 1]) for i in range(1000)]
    config = BenchmarkConfig("x:1", WorkloadConfig(), metric_percentiles=(99.99999, 100))
    run = build_result(config, 1.0, records, 1.0)
    assert run["p100_ttft_ms"] == pytest.approx(1000.0)
    assert run["p99.99999_ttft_ms"] == pytest.approx(999.9999001)


@pytest.mark.parametrize("bad", ["0", "101", "x", "50,"])
def test_a_bad_percentile_exits_2_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--addr", "127.0.0.1:1", "--model", "tiny-random", "--metric-percentiles", bad])
    assert exited.value.code == 2 and "--metric-percentiles" in capsys.readouterr().err
