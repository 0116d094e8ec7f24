"""A worker speed profile in round numbers, shared by the tests that predict from one."""

from __future__ import annotations

from pdserve.protocol.perf_profile import PerfProfile

# 1 ms per prompt token, a 20 ms decode step plus 5 ms per sequence: round numbers to reason with.
PROFILE = PerfProfile(
    prefill_fixed_s=0.01,
    prefill_per_token_s=1e-3,
    prefill_per_token2_s=0.0,
    decode_fixed_s=0.02,
    decode_per_seq_s=0.005,
)
