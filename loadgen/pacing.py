"""Whether loadgen sent the rate it was asked for. A client that falls behind (its loop too busy to send on time,
or the concurrency bound full) offers the server less than the `request_rate` its result names; these figures say
how much less, and a warning says so, so that no one publishes a rate that was never sent (measured: HTTP asked
for 200 req/s sent 139.6 req/s, p99 send lag 295 ms)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from loadgen.record import RequestRecord

LAG_WARNING_MS = 25.0  # p99 send lag past this: the arrivals sent are no longer the ones drawn
RATE_SHORTFALL = 0.95  # achieved below this share of the asked rate: the rate named is not the one sent


def send_lag_s(record: RequestRecord) -> float:
    """Loadgen's own lateness: from when the request was due to when it was handed to the bound (whose wait,
    wait_s, is the bound's, not loadgen's)."""
    return record.start_s - record.scheduled_s - record.wait_s


def send_rate(times_s: list[float], trace: bool) -> float:
    """Requests per second over these send times, as the asked rate is counted: n / last for drawn arrivals
    (the first comes after a gap, the last at n / rate), (n - 1) / (last - first) for a trace (its first at 0)."""
    span_s = max(times_s) - (min(times_s) if trace else 0.0)
    sent = len(times_s) - 1 if trace else len(times_s)
    return sent / span_s if span_s > 0 else math.inf


def pacing(
    records: list[RequestRecord], requested_rate: float, trace: bool, interrupted: bool = False
) -> dict[str, Any]:
    """The achieved send rate, loadgen's send lag and the bound's wait; `warnings` when it fell behind. A run cut
    short (`interrupted`) is held to the rate its schedule asked of the requests it sent: a prefix of Poisson
    arrivals strays from the whole run's rate by chance alone (12 sends at 2 req/s were due at 1.7 req/s)."""
    if not records:
        return {"achieved_request_rate": None, "warnings": []}
    lags_ms = np.array([send_lag_s(r) * 1e3 for r in records])
    waits_ms = np.array([r.wait_s * 1e3 for r in records])
    achieved = send_rate([r.start_s for r in records], trace)
    figures: dict[str, Any] = {
        "achieved_request_rate": "inf" if math.isinf(achieved) else achieved,
        "p50_send_lag_ms": float(np.percentile(lags_ms, 50)),
        "p99_send_lag_ms": float(np.percentile(lags_ms, 99)),
        "max_send_lag_ms": float(lags_ms.max()),
        "p99_concurrency_wait_ms": float(np.percentile(waits_ms, 99)),
        "max_concurrency_wait_ms": float(waits_ms.max()),
    }
    asked = send_rate([r.scheduled_s for r in records], trace) if interrupted else requested_rate
    asked_text = f"{asked:.1f} its schedule asked before the cut" if interrupted else f"{requested_rate:g} asked"
    short = achieved < RATE_SHORTFALL * asked
    lagging = figures["p99_send_lag_ms"] > LAG_WARNING_MS
    tripped = []
    if short:
        tripped.append(f"achieved rate under {RATE_SHORTFALL:.0%} of the asked")
    if lagging:
        tripped.append(f"p99 send lag over {LAG_WARNING_MS:g} ms")
    warnings = []
    if tripped and not math.isinf(requested_rate):  # all at once has no rate to keep
        offered = "the server was offered less than request_rate says"
        if not short:
            offered = "the rate held over the run, but the arrivals sent were not the ones drawn"
        warnings.append(
            f"loadgen fell behind ({' and '.join(tripped)}): it sent {achieved:.1f} req/s of the {asked_text} "
            f"(send lag p99 {figures['p99_send_lag_ms']:.0f} ms, max {figures['max_send_lag_ms']:.0f} ms; "
            f"concurrency wait max {figures['max_concurrency_wait_ms']:.0f} ms): {offered}"
        )
    return figures | {"warnings": warnings}
