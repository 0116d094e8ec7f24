"""What a router's counters counted (`pdserve_requests_total`, `pdserve_worker_ejections_total`), read from its
telemetry's Prometheus registry."""

from __future__ import annotations

from pdserve.telemetry import Telemetry


def requests_by_outcome(telemetry: Telemetry) -> dict[tuple[str, ...], float]:
    """(outcome, tenant) -> requests counted, the series still at 0 (each known tenant's start there) left out."""
    return _counted(telemetry, "pdserve_requests_total", "outcome", "tenant")


def ejections_by_reason(telemetry: Telemetry) -> dict[tuple[str, ...], float]:
    """(worker_id, reason) -> the router's ejections of that worker for that reason."""
    return _counted(telemetry, "pdserve_worker_ejections_total", "worker_id", "reason")


def _counted(telemetry: Telemetry, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels[label] for label in labels): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == name and s.value
    }
