"""loadgen's bad flags and traces are usage errors (exit 2, the flag or line named) before anything is sent;
its CDF plots count the requests its percentiles count."""

from __future__ import annotations

import argparse
import time

import pytest

from loadgen import benchmark
from loadgen.__main__ import _bench_parser, main
from loadgen.benchmark import BenchmarkConfig, build_result
from loadgen.plots import completed_values
from loadgen.record import RequestRecord
from loadgen.workload import WorkloadConfig

UNREACHABLE = ["--addr", "127.0.0.1:1", "--model", "tiny-random"]  # nothing listens: a run would fail with 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--burstiness", "nan"],
        ["--burstiness", "0"],
        ["--burstiness", "1e-300"],
        ["--burstiness", "1e7"],
        ["--request-rate", "0"],
        ["--request-rate", "nan"],
        ["--request-rate", "2,1e303"],
        ["--max-concurrency", "0"],
        ["--max-concurrency", "-1"],
        ["--seed", "-1"],
    ],
)
def test_bad_arrival_flags_exit_2_naming_the_flag(flags, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*UNREACHABLE, *flags])
    assert exited.value.code == 2 and flags[0] in capsys.readouterr().err


def test_a_burstiness_whose_gamma_gaps_underflow_says_the_range_and_why(capsys):
    """1e-300 drew every gap 0: the whole run went at once, a rate in its result that was never offered."""
    with pytest.raises(SystemExit) as exited:
        main([*UNREACHABLE, "--burstiness", "1e-300"])
    err = " ".join(capsys.readouterr().err.split())
    assert exited.value.code == 2
    assert "--burstiness: burstiness must lie in [0.02, 1e+06], got 1e-300" in err and "underflow to 0" in err


def test_a_request_rate_no_sender_keeps_says_the_bound_and_that_inf_names_it(capsys):
    """1e303 was taken: sent all at once, its result (and a sweep's goodput) named a rate never offered."""
    with pytest.raises(SystemExit) as exited:
        main([*UNREACHABLE, "--request-rate", "1e303"])
    err = " ".join(capsys.readouterr().err.split())
    assert exited.value.code == 2
    assert "--request-rate/--sweep: request rate must be at most 1e+06 req/s, or inf, got 1e+303" in err, err


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "ftp://h:1", "http://"])
def test_a_base_url_that_is_no_http_url_exits_2_naming_the_flag(url, capsys):
    """It was refused only by the check request's HTTP client: exit 1, `UNAVAILABLE: UnsupportedProtocol`."""
    with pytest.raises(SystemExit) as exited:
        main(["--backend", "openai", "--base-url", url, "--model", "tiny-random", "--num-prompts", "1"])
    assert exited.value.code == 2 and "--base-url" in capsys.readouterr().err


def test_a_missing_or_bad_trace_exits_2_before_anything_is_sent(tmp_path, capsys):
    assert main([*UNREACHABLE, "--dataset-name", "trace", "--trace", str(tmp_path / "none.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 4}\n')
    assert main([*UNREACHABLE, "--dataset-name", "trace", "--trace", str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err


def test_outputs_that_cannot_be_written_and_bad_bounds_exit_2_before_anything_is_sent(tmp_path, capsys):
    """Against an address where nothing listens, a run would fail with 1: 2 is the check before it."""
    (tmp_path / "file").write_text("")
    for flags, says in (
        (["--result-json", str(tmp_path)], "--result-json"),
        (["--plot-dir", str(tmp_path / "file")], "--plot-dir"),
        # A file on the way: the folders' making failed once the run was over, the JSON never written (exit 1).
        (["--result-json", str(tmp_path / "file" / "sub" / "r.json")], f"{tmp_path / 'file'} is a file"),
        (["--plot-dir", str(tmp_path / "file" / "plots")], f"{tmp_path / 'file'} is a file"),
        (["--goodput", "ttft:abc"], "--goodput bound must be a number of ms"),
    ):
        assert main([*UNREACHABLE, *flags]) == 2
        assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--trace", "t.jsonl"], "--trace is replayed only with --dataset-name trace, not random"),
        (["--endpoint", "/v1/completions"], "--endpoint is for the openai backends"),
        (["--served-model-name", "m"], "--served-model-name is for the openai backends"),
    ],
)
def test_a_flag_the_run_would_not_use_exits_2_before_anything_is_sent(flags, says, tmp_path, capsys):
    """`--trace` without `--dataset-name trace` sent the random workload and recorded `"trace": PATH` as if
    replayed; the openai backends' flags with gRPC were recorded as what ran too."""
    (tmp_path / "t.jsonl").write_text('{"timestamp": 0, "input_length": 4, "output_length": 2}\n')
    flags = [str(tmp_path / f) if f.endswith(".jsonl") else f for f in flags]
    assert main([*UNREACHABLE, *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("goodput", [[], ["--goodput", "e2el:500"]])
def test_send_slo_without_a_ttft_or_tpot_bound_exits_2_naming_what_it_needs(goodput, capsys):
    """It sent SLO(ttft_ms=0, tpot_ms=0), which the router reads as its defaults: the requests went as without the
    flag, and the result recorded `send_slo: true`. With a bound it sends (nothing listens here: exit 1)."""
    assert main([*UNREACHABLE, "--send-slo", *goodput]) == 2
    assert "--send-slo sends the --goodput ttft and tpot bounds" in capsys.readouterr().err
    assert main([*UNREACHABLE, "--num-prompts", "1", "--send-slo", "--goodput", "tpot:50"]) == 1


def test_the_cdf_plots_only_completed_requests():
    ok, failed = RequestRecord("a", 4, 3, 0.0), RequestRecord("b", 4, 3, 0.0, status="UNAVAILABLE")
    for r, ttft in ((ok, 0.1), (failed, 0.05)):  # the failed one had its first token, then lost its worker
        r.message_times_s, r.message_tokens = [ttft, ttft + 0.1], [1, 1]
    run = build_result(BenchmarkConfig(address="x:1", workload=WorkloadConfig()), 1.0, [ok, failed], 1.0)
    assert list(completed_values(run, "ttft")) == [100.0]


def test_an_address_nothing_listens_at_fails_at_once_saying_so(capsys):
    """It waited the channel's 30 s, then said only that no answer came."""
    start = time.monotonic()
    assert main([*UNREACHABLE, "--num-prompts", "2"]) == 1
    assert time.monotonic() - start < 10
    assert "nothing listens at 127.0.0.1:1 (connection refused)" in capsys.readouterr().err


def test_help_shows_each_flags_default_as_pdserves_does(capsys):
    """The CLI contract (docs/architecture.md): --help shows every flag with its default; loadgen's showed none."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    shown = 0
    for action in _bench_parser()._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) and action.default is not False:
            assert f"{action.help} (default: {action.default})" in text, action.option_strings
            shown += 1
    assert shown > 10 and "(default: None)" not in text and "(default: [])" not in text


@pytest.mark.parametrize(
    ("status", "error", "code", "hint"),
    [
        ("INVALID_ARGUMENT", "prompt_token_ids: ids [50000] are outside the vocabulary [0, 1000)", 2, True),
        ("INVALID_ARGUMENT", "prompt_token_ids: 5000 tokens leave no room to generate in the context", 2, False),
        ("UNAVAILABLE", "no prefill worker is serving", 1, False),
    ],
)
def test_a_check_request_refused_as_invalid_is_a_usage_error_with_the_model_hint_only_for_the_vocabulary(
    capsys, monkeypatch, status, error, code, hint
):
    """A prompt too long for the right model was told to pass the model the server serves, and exited 1."""

    class RefusingClient:
        def __init__(self, *args: object) -> None:
            pass

        async def check(self, request: object) -> RequestRecord:
            return RequestRecord("check", 5000, 4, 0.0, status=status, error=error)

    monkeypatch.setattr(benchmark, "make_backend", lambda config: None)
    monkeypatch.setattr(benchmark, "Client", RefusingClient)
    assert main([*UNREACHABLE, "--num-prompts", "1"]) == code
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"loadgen: the check request failed: {status}: {error}")
    assert ("pass the model the server serves" in line) == hint


@pytest.mark.parametrize(
    ("flags", "says"),
    [  # the gaps would be ~1e12 s and 1e7 s; 10**8 prompts would need 4 TB before the first went
        (["--request-rate", "1e-12"], "--request-rate 1e-12 spreads 1000 requests over 1e+15 s, past the 1e+09 s"),
        (["--request-rate", "2,1e-7"], "--request-rate 1e-07 spreads 1000 requests over 1e+10 s, past the 1e+09 s"),
        (["--num-prompts", "1000001", "--random-input-len", "1"], "--num-prompts must be at most 1,000,000"),
        (["--dataset-name", "trace", "--trace", "/dev/zero"], "--trace /dev/zero is over 268,435,456 bytes"),
    ],
)
def test_a_run_past_loadgens_bounds_exits_2_before_anything_is_sent(flags, says, capsys):
    assert main([*UNREACHABLE, *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_trace_replayed_past_the_arrivals_span_exits_2_unless_num_prompts_stops_short_of_it(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {t}, "input_length": 4, "output_length": 2}}\n' for t in (0, 1, 1e300)))
    assert main([*UNREACHABLE, "--dataset-name", "trace", "--trace", str(trace)]) == 2
    assert f"trace {trace} spans 1e+297 s, past the 1e+09 s" in capsys.readouterr().err
    assert main([*UNREACHABLE, "--dataset-name", "trace", "--trace", str(trace), "--num-prompts", "2"]) == 1
