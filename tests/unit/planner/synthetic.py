"""A hand-written hardware profile: round numbers the tests can reason about, no measurement."""

from __future__ import annotations

from pdserve.planner.hardware import HardwareProfile
from pdserve.protocol.perf_profile import PerfProfile

PERF = PerfProfile(
    prefill_fixed_s=0.005,
    prefill_per_token_s=0.0002,  # 512 tokens: ~0.11 s
    prefill_per_token2_s=0.0,
    decode_fixed_s=0.01,
    decode_per_seq_s=0.002,  # a batch of 25: ~60 ms a step, so decode saturates under a 60 ms TPOT SLO
)


def synthetic_profile(kv_capacity_tokens: int = 200_000, **overrides: object) -> HardwareProfile:
    fields = {
        "perf": PERF,
        "decode_per_context_token_s": 1e-7,
        "prefill_per_context_token_s": 0.0,
        "step_overhead_s": 0.0,
        "kv_bytes_per_token": 1000,
        "kv_capacity_tokens": kv_capacity_tokens,
        "transfer_gbps": 1.0,
        "transfer_latency_s": 0.001,
    }
    return HardwareProfile(**{**fields, **overrides})  # type: ignore[arg-type]
