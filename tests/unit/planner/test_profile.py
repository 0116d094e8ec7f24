"""`pdserve profile --quick` on tiny-random: a profile the planner loads, from real measurements."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import cli
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.profiler import QUICK


def test_profile_quick_writes_a_profile_the_planner_reads(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", "tiny-random", "--quick", "--kv-cache-gb", "0.05", "--threads", "1"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    profile = HardwareProfile.load(out)
    assert profile.meta["model"] == "tiny-random" and profile.meta["device"] == "cpu"
    assert profile.meta["backend"] == "gloo"
    # every grid point that fits was measured, and took time
    prefill, decode = profile.points["prefill"], profile.points["decode"]
    assert len(prefill) == len(QUICK.prompt_lens) * len(QUICK.prefill_batches)
    assert len(decode) == len(QUICK.decode_batches) * len(QUICK.contexts)
    assert all(s > 0 for *_, s in prefill + decode)
    assert profile.perf.prefill_s(256) > 0 and profile.perf.decode_step_s(1) > 0
    assert len(profile.points["transfer"]) == 2 and 0 < profile.transfer_gbps < 1e6
    # the cache the engine built for 0.05 GiB (its "GB" are 2**30 bytes), in whole 16-token blocks
    assert profile.kv_capacity_tokens == int(0.05 * 2**30) // (16 * profile.kv_bytes_per_token) * 16


def test_the_transfer_is_measured_over_nccl_only_between_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.planner.profiler import transfer_endpoints

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert transfer_endpoints("cpu") == ("gloo", "cpu")
    assert transfer_endpoints("cuda:0") == ("gloo", "cuda:0")  # NCCL cannot pair a GPU with itself
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert transfer_endpoints("cuda") == ("nccl", "cuda:1")
    assert transfer_endpoints("cuda:1") == ("nccl", "cuda:0")
