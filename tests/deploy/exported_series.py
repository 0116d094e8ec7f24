"""The series pdserve's routers, workers and controller export, read back from a real Prometheus registry after
each instrument recorded once, the way the services record them: a test of the chart's alert rules checks every
metric, label and label value they select against this, so a metric or label renamed in the code fails it."""

from __future__ import annotations

from functools import cache

from pdserve.metrics import RouterMetrics, SupervisionMetrics, WorkerMetrics
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.telemetry import Telemetry
from services.router.retry import EJECTION_REASONS

# What Prometheus adds to every series it scrapes through prometheus-operator's monitors, and `up`, which it makes
# for each target with those labels alone.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint", "service"})
Series = dict[str, dict[str, set[str]]]  # sample name -> label name -> the values seen


@cache
def exported() -> Series:
    """Sample names (a histogram's `_bucket`, `_sum`, `_count`; a counter's `_total`, as the exporter names them)
    with each label's values, plus `up`."""
    telemetry = Telemetry("pdserve-alerts-test")
    router = RouterMetrics(telemetry.meter, tenants=["", "tenant-a"])  # each outcome and reason from 0
    for histogram in (router.ttft, router.tpot, router.e2e):  # as services/router/relay.py and ended() record them
        histogram.record(0.1, {"tenant": "tenant-a"})
    router.itl.record(0.01)
    router.slo_judged("tenant-a", "default", True, True)  # as services/router/relay.py judges a finished request
    worker = WorkerState("decode-0", Role.DECODE, "10.0.0.1:50061")
    for reason in EJECTION_REASONS:
        router.ejected(worker, reason)
    for role in (Role.PREFILL, Role.DECODE):
        metrics = WorkerMetrics(telemetry.meter, f"{role}-0", str(role), lambda: {})
        metrics.stepped(8, 0.01)
        metrics.track_speed(lambda: 1.0)
        metrics.transfer_seconds.record(0.01, metrics.labels)
        metrics.transfer_bytes.add(1, metrics.labels)
    SupervisionMetrics(telemetry.meter, [Role.PREFILL, Role.DECODE])  # each role from 0
    series: Series = {"up": {}}
    for family in telemetry.registry.collect():
        for sample in family.samples:
            labels = series.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    telemetry.shutdown()
    return series
