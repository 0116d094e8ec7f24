"""The SLO a finished request is judged by, for `pdserve_requests_slo_total`: the one it set, else its priority
class's (`[[router.slo_classes]]`), else the router's default; labelled by which, so attainment reads per class.

Judged as the caller saw it: TTFT from the request's arrival at the router (a retry's included), TPOT as vLLM
defines it. A request that set no SLO is held to its class's as it is, not to the room admission gives a prompt
whose own cost is past it: a miss there is one a caller of that class saw.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.config import RouterConfig, SLOClass
from services.router.request import RoutedRequest

OWN, DEFAULT = "own", "default"


def class_label(slo_class: SLOClass) -> str:
    return f"priority>={slo_class.priority}"


def slo_labels(config: RouterConfig) -> Iterable[str]:
    """Every label a request's SLO may have: a closed set, each exported from 0."""
    return (OWN, DEFAULT, *map(class_label, config.slo_classes))


def judged_slo(config: RouterConfig, request: RoutedRequest) -> tuple[str, float, float]:
    """The request's SLO's label, and its TTFT and TPOT bounds in seconds (config.slo_for's)."""
    ttft_ms, tpot_ms = config.slo_for(request.priority, request.ttft_slo_ms, request.tpot_slo_ms)
    if request.ttft_slo_ms or request.tpot_slo_ms:
        label = OWN
    else:
        under = [c for c in config.slo_classes if request.priority >= c.priority]
        label = class_label(max(under, key=lambda c: c.priority)) if under else DEFAULT
    return label, ttft_ms / 1e3, tpot_ms / 1e3
