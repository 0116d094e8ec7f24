"""--threads, which every command that builds an engine takes, is bounded: 100000 was a segmentation fault (exit
139) once torch made its threads, after the model had loaded."""

from __future__ import annotations

import pytest

from pdserve.cli import _parser
from pdserve.config import ConfigError, EngineConfig


@pytest.mark.parametrize(
    "command",
    [["generate", "--prompt", "hi"], ["profile", "--out", "p.json"], ["up"], ["bench", "engine"], ["bench", "guided"]],
)
def test_more_threads_than_any_host_runs_is_a_usage_error_as_the_flags_parse(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([*command, "--threads", "100000"])
    assert exit_.value.code == 2 and "argument --threads: must be at most 1024, got 100000" in capsys.readouterr().err
    assert _parser().parse_args([*command, "--threads", "1024"]).threads == 1024


def test_an_engine_config_refuses_what_its_flag_refuses() -> None:
    with pytest.raises(ConfigError, match="num_threads must be at most 1024, got 100000"):
        EngineConfig(num_threads=100000)
