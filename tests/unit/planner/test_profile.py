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
    assert profile.meta["context_tokens"] == 4096  # tiny-random's max_position_embeddings: what plan checks against
    # every grid point that fits was measured, and took time
    prefill, decode = profile.points["prefill"], profile.points["decode"]
    assert len(prefill) == len(QUICK.prompt_lens) * len(QUICK.prefill_batches)
    assert len(decode) == len(QUICK.decode_batches) * len(QUICK.contexts)
    assert all(s > 0 for *_, s in prefill + decode)
    # a 512-token chunk at each of QUICK's contexts; real engine decode steps at its first two batch sizes
    assert len(profile.points["prefill_chunk"]) == len(QUICK.chunk_contexts) * len(QUICK.prefill_batches)
    assert [b for b, _, _ in profile.points["engine_decode"]] == list(QUICK.decode_batches[:2])
    assert profile.prefill_per_context_token_s >= 0 and profile.step_overhead_s >= 0
    assert profile.perf.prefill_s(256) > 0 and profile.perf.decode_step_s(1) > 0
    assert len(profile.points["transfer"]) == 2 and 0 <= profile.transfer_gbps < 1e6
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


def test_the_fit_finds_a_later_chunks_context_cost_and_the_engines_step_overhead() -> None:
    """Points made from known terms give the terms back."""
    from pdserve.planner.profiler import fit

    def prefill(n: int, b: int) -> float:
        return 0.001 + b * 2e-5 * n

    def decode(b: int, c: float) -> float:
        return 0.002 + 1e-4 * b + 1e-7 * b * c

    per_cached, overhead = 3e-8, 0.0007
    points = {
        "prefill": [[n, b, prefill(n, b)] for n in (64, 256, 1024) for b in (1, 4)],
        "prefill_chunk": [[512, b, c, prefill(512, b) + per_cached * b * 512 * c] for c in (0, 512) for b in (1, 4)],
        "decode": [[b, c, decode(b, c)] for b in (1, 8) for c in (64, 512)],
        "engine_decode": [[b, 72, decode(b, 72) + overhead] for b in (1, 8)],
    }
    perf, per_context, got_per_cached, got_overhead = fit(points)
    assert per_context == pytest.approx(1e-7, rel=1e-3)
    assert got_per_cached == pytest.approx(per_cached, rel=1e-3)
    assert got_overhead == pytest.approx(overhead, rel=1e-3)


def test_the_transfer_fit_is_a_latency_plus_bytes_and_never_counts_the_latency_twice() -> None:
    """Transfers that grow with their bytes give the bandwidth and latency back; where the 8x larger one was no
    slower, the bytes cost nothing the profile can see: the latency alone predicts both, as measured."""
    from dataclasses import replace

    from pdserve.planner.profiler import fit_transfer
    from tests.unit.planner.synthetic import synthetic_profile

    mib = 1 << 20
    gbps, latency = fit_transfer([[mib, 0.002 + mib / 2e9], [8 * mib, 0.002 + 8 * mib / 2e9]])
    assert gbps == pytest.approx(2.0) and latency == pytest.approx(0.002)
    gbps, latency = fit_transfer([[mib, 0.0040], [8 * mib, 0.0038]])
    profile = replace(synthetic_profile(kv_bytes_per_token=512), transfer_gbps=gbps, transfer_latency_s=latency)
    assert [profile.transfer_s(2048), profile.transfer_s(16384)] == pytest.approx([0.0039, 0.0039])
