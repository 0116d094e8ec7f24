"""`pdserve profile` answers what it cannot measure in one line and a status, never a traceback: a KV cache too
large to count or to hold, one too small for the grid, a model folder without weights, timings the host's noise
flattened."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli import _parser, main
from pdserve.config import ConfigError, EngineConfig
from pdserve.planner.profiler import NoisyMeasurement, fit

PROFILE = ["profile", "--model", "tiny-random", "--quick", "--threads", "1", "--transfer-gbps", "1"]


@pytest.mark.parametrize("command", [[*PROFILE, "--out", "p.json"], ["up"], ["controller"], ["chaos"]])
def test_a_kv_cache_no_host_holds_is_a_usage_error_as_the_flags_parse(capsys, command):
    """1e303 GiB overflowed the block count: an OverflowError traceback from profile, a worker that never started
    under up (and chaos, which starts one)."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([*command, "--kv-cache-gb", "1e303"])
    assert exit_.value.code == 2
    assert "argument --kv-cache-gb: must be at most 1e+06 GiB, got 1e303" in capsys.readouterr().err


def test_an_engine_config_refuses_what_its_flag_refuses() -> None:
    with pytest.raises(ConfigError, match="kv_cache_memory_gb must be at most 1e"):
        EngineConfig(kv_cache_memory_gb=1e303)


@pytest.mark.parametrize(
    ("flags", "status", "says"),
    [
        (["--kv-cache-gb", "1e-300"], 2, "the engine's cache holds none of the profile's shapes; raise --kv-cache-gb"),
        (["--kv-cache-gb", "1e6"], 1, "out of memory for a KV cache of --kv-cache-gb 1e+06"),  # 2**50 bytes: anywhere
        (["--model", "{empty}"], 2, "no *.safetensors in"),
    ],
)
def test_what_the_engine_cannot_build_is_one_line_not_a_traceback(tmp_path: Path, capsys, flags, status, says):
    argv = [*PROFILE, "--out", str(tmp_path / "p.json"), *(f.format(empty=tmp_path) for f in flags)]
    assert main(argv) == status
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pdserve profile: ") and says in line, line
    assert not (tmp_path / "p.json").exists()


def test_prefill_times_the_noise_flattened_are_said_not_a_traceback_after_the_whole_grid() -> None:
    """A busy host timed the longer prompts faster: the fit gave a prompt no cost per token, which HardwareProfile
    refused as a damaged file would be, a ValueError traceback once every point had been measured (seen twice here
    in this review's runs, under a load average of 87)."""
    points = {
        "prefill": [[n, 1, s] for n, s in ((32, 0.0013), (128, 0.0012), (256, 0.0011))],
        "decode": [[b, c, 0.001 + 1e-4 * b] for b in (1, 4) for c in (64, 256)],
    }
    with pytest.raises(
        NoisyMeasurement, match=r"longer prompts prefilled no slower \(32 tokens 1.30 ms, 128 tokens 1.20 ms"
    ):
        fit(points)
