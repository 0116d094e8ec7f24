"""The chaos run's plan and verdict: where the stops fall among the kills, and how each request is counted."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.chaos.command import chaos_config
from pdserve.chaos.faults import Fault
from pdserve.chaos.load import Outcome
from pdserve.chaos.report import clean, summarize
from pdserve.chaos.run import ChaosConfig


def test_stops_spread_evenly_among_the_kills_decode_first():
    plan = ChaosConfig(kills=20, stops=2).schedule()
    assert len(plan) == 22 and plan.count(("kill", "")) == 20
    stops = [(i, role) for i, (kind, role) in enumerate(plan) if kind == "stop"]
    assert stops == [(6, "decode"), (14, "prefill")]
    assert ChaosConfig(kills=3, stops=0).schedule() == [("kill", "")] * 3


def test_each_request_is_completed_failed_or_lost_and_completed_ones_are_checked_against_the_reference():
    reference = [[1, 2, 3], [4, 5, 6]]
    outcomes = [
        Outcome("right", 0, [1, 2, 3], finished=True, ended=True),
        Outcome("wrong", 1, [4, 5, 7], finished=True, ended=True),
        Outcome("failed", 1, [4], status="UNAVAILABLE", error="gone", ended=True),
        Outcome("cut", 0, [1, 2], ended=True),  # the stream ended without a final message
        Outcome("hung", 0, [1]),  # never ended
    ]
    faults = [Fault("kill", "decode-2", "decode", 10, 1.0, recover_s=4.0), Fault("stop", "p", "prefill", 11, 9.0)]
    report = summarize(outcomes, reference, faults, {"decode-2": 0, "prefill-0": 3}, in_flight=0)
    assert (report["completed"], report["completed_right_output"], report["completed_wrong_output"]) == (2, 1, 1)
    assert (report["failed"], report["failed_by_status"], report["lost"]) == (1, {"UNAVAILABLE": 1}, 2)
    assert report["kv_blocks_held_after_idle"] == 3
    assert report["recover_s"] == {"kill": {"p50": 4.0, "max": 4.0}, "stop": {"p50": None, "max": None}}
    assert report["not_recovered"] == 1
    assert not clean(report)
    assert clean(summarize(outcomes[:1], reference, faults[:1], {"decode-2": 0}, in_flight=0))
    assert not clean(summarize(outcomes[:1], reference, faults[:1], {"decode-2": 0}, in_flight=1))


def test_the_flags_set_the_run() -> None:
    argv = ["chaos", "--kills", "5", "--interval", "2", "--stops", "0", "--stop-s", "9", "--rate", "1.5", "--seed", "7"]
    config = chaos_config(cli._parser().parse_args(argv))
    got = (config.kills, config.interval_s, config.stops, config.stop_s, config.rate, config.seed)
    assert got == (5, 2, 0, 9, 1.5, 7)
    assert (config.input_len, config.output_len) == (ChaosConfig.input_len, ChaosConfig.output_len)


def test_bad_flags_and_an_unreachable_router_are_one_line_each(capsys):
    for flag, says in (("--rate=-1", "--rate: must be a positive number"), ("--kills=-2", "--kills: must lie in")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["chaos", "--addr", "127.0.0.1:1", flag])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err
    assert cli.main(["chaos", "--addr", "127.0.0.1:1", "--kills", "1"]) == 1
    assert capsys.readouterr().err.startswith("pdserve chaos: the router: UNAVAILABLE: ")


@pytest.mark.parametrize(
    ("flags", "tokens"), [(["--output-len", str(2**32)], 2**32 + 64), (["--input-len", "5000"], 5120)]
)
def test_lengths_past_the_models_context_are_one_line_before_any_load(capsys, flags, tokens):
    """Every request would be refused (found only once a started cluster served); --output-len 2**32 was a
    ValueError traceback ("Value out of range") as the first request was built."""
    assert cli.main(["chaos", "--addr", "127.0.0.1:1", *flags]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("pdserve chaos: --input-len ") and f"= {tokens} tokens exceed tiny-random's context" in line


def test_a_stop_no_run_outlasts_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli._parser().parse_args(["chaos", "--stop-s", "1e303"])
    assert exit_.value.code == 2 and "argument --stop-s: must lie in (0, 1e+06], got 1e303" in capsys.readouterr().err
