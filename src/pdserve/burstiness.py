"""The gamma shape of arrival gaps (`--burstiness` of loadgen and `pdserve plan`, vLLM's name): 1 is Poisson, below
1 burstier, above more regular (the gaps' coefficient of variation is 1 / sqrt(shape)). One range for both, where
float64's draws still mean what the shape says: below 0.02 they underflow to 0 (measured: 0.06% of the draws at
0.01, 47% at 0.001, every one at 1e-10, which loadgen sent as all at once and the planner made NaN arrivals), and
above 1e6 the gaps are regular to 0.1% (loadgen's gamma scale, 1 / (rate * shape), reached 0 near 1e308: all at
once again)."""

from __future__ import annotations

MIN_BURSTINESS = 0.02  # none of 2,000,000 draws was 0 here (0.01: 0.06%)
MAX_BURSTINESS = 1e6  # the gaps' spread 0.1% of their mean: as regular as a sender keeps them


def check_burstiness(shape: float) -> float:
    """`shape`, or a ValueError saying the range and why it ends where it does (nan is out)."""
    if not MIN_BURSTINESS <= shape <= MAX_BURSTINESS:
        raise ValueError(
            f"burstiness must lie in [{MIN_BURSTINESS:g}, {MAX_BURSTINESS:g}], got {shape:g}: below, the gamma "
            "gaps underflow to 0 (all requests at once); above, they are regular to 0.1% already"
        )
    return shape
