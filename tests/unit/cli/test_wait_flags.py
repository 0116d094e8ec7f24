"""The waits `pdserve autoscale` takes are bounded as the other commands' are (MAX_SECONDS): --window 1e303 --once
collected its load forever, and --interval 1e-9 asked a router's status about 100 times a second (829 decisions
printed in 8 s), where its tests need 0.2 s. (scale --timeout: test_command_errors.py.)"""

from __future__ import annotations

import pytest

from pdserve.cli import _parser

AUTOSCALE = ["autoscale", "--addr", "127.0.0.1:1", "--profile", "p.json", "--max-workers", "2"]
AUTOSCALE += ["--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([*AUTOSCALE, "--interval", "1e-9"], "argument --interval: must lie in [0.1, 1e+06], got 1e-9"),
        ([*AUTOSCALE, "--interval", "1e303"], "argument --interval: must lie in [0.1, 1e+06], got 1e303"),
        ([*AUTOSCALE, "--window", "1e303", "--once"], "argument --window: must lie in (0, 1e+06], got 1e303"),
    ],
)
def test_a_wait_past_the_bounds_is_a_usage_error_as_the_flags_parse(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_waits_the_docs_and_tests_use_are_taken():
    args = _parser().parse_args([*AUTOSCALE, "--interval", "0.2", "--window", "0.001"])
    assert (args.interval, args.window) == (0.2, 0.001)
