"""The series pdserve's routers, workers and controller export, read back from real Prometheus registries after
each instrument recorded once, the way the services record them: a test of the chart's alert rules or its Grafana
dashboard checks every metric, label and label value they select against this, so a metric or label renamed in the
code fails it."""

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


def _router(telemetry: Telemetry) -> None:
    router = RouterMetrics(telemetry.meter, tenants=["", "tenant-a"])  # each outcome and reason from 0
    for histogram in (router.ttft, router.tpot, router.e2e):  # as services/router/relay.py and ended() record them
        histogram.record(0.1, {"tenant": "tenant-a"})
    router.itl.record(0.01)
    router.slo_judged("tenant-a", "default", True, True)  # as services/router/relay.py judges a finished request
    worker = WorkerState("decode-0", Role.DECODE, "10.0.0.1:50061")
    for reason in EJECTION_REASONS:
        router.ejected(worker, reason)


def _worker(telemetry: Telemetry, role: Role) -> None:
    metrics = WorkerMetrics(telemetry.meter, f"{role}-0", str(role), lambda: {})
    metrics.stepped(8, 0.01)
    metrics.track_speed(lambda: 1.0)
    metrics.requests_timed([0.01], [0.01], [0.01])  # as the engine reports a step's requests (on_request_times)
    metrics.transfer_seconds.record(0.01, metrics.labels)
    metrics.transfer_bytes.add(1, metrics.labels)


def merged(*several: Series) -> Series:
    """The series of several targets together: each sample name's labels with the values any of them took."""
    into: Series = {}
    for series in several:
        for name, labels in series.items():
            into_labels = into.setdefault(name, {})
            for label, values in labels.items():
                into_labels.setdefault(label, set()).update(values)
    return into


@cache
def exported_by_component() -> dict[str, Series]:
    """Each of the chart's components' series (router, prefill, decode, controller: the pods' component label), from
    a registry of its own as each runs in a process of its own, plus `up`, which Prometheus makes for each target."""
    components = {
        "router": _router,
        "prefill": lambda t: _worker(t, Role.PREFILL),
        "decode": lambda t: _worker(t, Role.DECODE),
        "controller": lambda t: SupervisionMetrics(t.meter, [Role.PREFILL, Role.DECODE]),  # each role from 0
    }
    by_component: dict[str, Series] = {}
    for component, record in components.items():
        telemetry = Telemetry(f"pdserve-{component}")
        record(telemetry)
        samples = [sample for family in telemetry.registry.collect() for sample in family.samples]
        telemetry.shutdown()
        each = ({s.name: {label: {value} for label, value in s.labels.items()}} for s in samples)
        by_component[component] = merged({"up": {}}, *each)
    return by_component


@cache
def exported() -> Series:
    """Sample names (a histogram's `_bucket`, `_sum`, `_count`; a counter's `_total`, as the exporter names them)
    with each label's values, over every component, plus `up`."""
    return merged(*exported_by_component().values())
