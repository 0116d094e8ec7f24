"""What a router's `pdserve_requests_total` counted, read from its telemetry's Prometheus registry."""

from __future__ import annotations

from pdserve.telemetry import Telemetry


def requests_by_outcome(telemetry: Telemetry) -> dict[tuple[str, str], float]:
    """(outcome, tenant) -> requests counted, the series still at 0 (each known tenant's start there) left out."""
    return {
        (s.labels["outcome"], s.labels["tenant"]): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_requests_total" and s.value
    }
