"""Telemetry set-up: nothing exported without OTEL_* settings, context across a grpc.aio hop, JSON logs."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import context, trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve.cluster.drain_service import add_control_service
from pdserve.cluster.local_process import free_port
from pdserve.config import ClusterConfig, RouterConfig
from pdserve.log_setup import JsonFormatter
from pdserve.metrics import KV_TRANSFER_FAILURE_REASONS, RouterMetrics, SupervisionMetrics, WorkerMetrics
from pdserve.protocol.roles import Role
from pdserve.rpc.server import Server, channel
from pdserve.telemetry import (
    FINAL_EXPORT_S,
    LATENCY_BUCKETS_S,
    MAX_ATTRIBUTE_CHARS,
    STEP_BUCKETS_S,
    TOKEN_BUCKETS_S,
    TRANSFER_BUCKETS_S,
    Telemetry,
    default_span_processors,
    request_id_var,
)
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.cluster_view import serving_collector


def test_nothing_exported_without_otel_settings(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert default_span_processors() == []
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert default_span_processors() == []


def test_every_exporter_otel_traces_exporter_lists_is_used(monkeypatch, caplog):
    """The variable is a comma-separated list (OpenTelemetry's spec): "otlp,console" exported nothing."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " otlp, console,zipkin ")
    exporters = [type(p.span_exporter).__name__ for p in default_span_processors()]
    assert exporters == ["OTLPSpanExporter", "ConsoleSpanExporter"]
    assert "'zipkin', which pdserve has no exporter for" in caplog.text
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp_proto_grpc")  # opentelemetry-python's names name a protocol
    (grpc_otlp,) = default_span_processors()
    assert type(grpc_otlp.span_exporter).__module__.endswith("proto.grpc.trace_exporter")


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def _add_echo(server: grpc.aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),))


async def _never_drained(timeout_s: float) -> None:
    raise AssertionError("not asked to drain")


async def test_one_trace_across_a_grpc_hop_with_a_provider_per_service_and_none_for_health_checks():
    exporter = InMemorySpanExporter()
    server_side = Telemetry("pdserve-decode", span_processor=SimpleSpanProcessor(exporter))
    client_side = Telemetry("pdserve-router", span_processor=SimpleSpanProcessor(exporter))
    server = Server("127.0.0.1", 0, server_side.server_interceptors())
    server.add(_add_echo, ["test.Echo"])
    add_control_service(server, _never_drained, "w")
    await server.start()
    await server.set_serving(True)
    try:
        async with channel(server.address, client_side.client_interceptors()) as ch:
            # a probe every few seconds from every pod: no trace of its own on either side
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            # nor a router's check of its cluster credentials, every 10 s to a few workers (router/peer_check.py)
            await worker_pb2_grpc.WorkerControlStub(ch).CheckPeer(worker_pb2.CheckPeerRequest(), timeout=5)
            assert exporter.get_finished_spans() == ()
            with client_side.tracer.start_as_current_span("admission"):
                assert await ch.unary_unary("/test.Echo/Echo")(b"hi", timeout=5) == b"hi"
    finally:
        await server.stop(None)
    spans = exporter.get_finished_spans()
    assert {s.resource.attributes["service.name"] for s in spans} == {"pdserve-router", "pdserve-decode"}
    assert len({s.context.trace_id for s in spans}) == 1
    ids = {s.context.span_id for s in spans}
    assert [s.name for s in spans if s.parent is None] == ["admission"]
    assert all(s.parent.span_id in ids for s in spans if s.parent is not None)


def test_json_log_lines_carry_the_request_id():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "done %s", ("ok",), None)
    record.outcome = "finished"
    token = request_id_var.set("req-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["msg"] == "done ok" and line["request_id"] == "req-1" and line["outcome"] == "finished"


def test_json_log_lines_carry_the_current_spans_trace_and_span_ids():
    """What leads from a log line to its trace: OpenTelemetry's trace_id and span_id, in lower hex."""
    telemetry = Telemetry("t", span_processor=SimpleSpanProcessor(InMemorySpanExporter()))

    def logged() -> dict:
        return json.loads(JsonFormatter().format(logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)))

    with telemetry.tracer.start_as_current_span("request") as span:
        inside = logged()
    ids = span.get_span_context()
    assert inside["trace_id"] == f"{ids.trace_id:032x}" and inside["span_id"] == f"{ids.span_id:016x}"
    assert "trace_id" not in logged() and "span_id" not in logged()
    # Tracing off, a caller's traceparent is the current span context, remote: no span of this process's to lead to.
    remote = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(ids.trace_id, 7, is_remote=True)))
    token = context.attach(remote)
    try:
        assert "trace_id" not in logged()
    finally:
        context.detach(token)
    telemetry.shutdown()


def test_the_slos_the_docs_use_are_histogram_bucket_edges():
    """SLO attainment is read from the histograms only at a bucket edge: the router's defaults and the SLOs the
    planner's and loadgen's examples in docs/ use (TTFT 0.5, 1, 10 s; TPOT 50, 60, 100 ms) must be edges."""
    config = RouterConfig()
    for ttft_s in (config.default_ttft_ms / 1e3, 0.5, 1.0, 10.0):
        assert ttft_s in LATENCY_BUCKETS_S
    for tpot_s in (config.default_tpot_ms / 1e3, 0.05, 0.06, 0.1):
        assert tpot_s in TOKEN_BUCKETS_S


# The bounds as first exported: an alert or dashboard may name any of them (`le="2.5"`).
EXPORTED_LATENCY_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
EXPORTED_TOKEN_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


def test_common_slos_are_bucket_bounds_and_no_bound_once_exported_is_gone():
    """A burn-rate alert on an SLO of 300 ms or 2 s (TTFT), 25 or 30 ms (TPOT) reads the bucket at that bound: with
    0.25, 0.5, 1, 2.5 s alone it could not be written. Every bound exported before stays, in order."""
    for ttft_s in (0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 30, 60):
        assert ttft_s in LATENCY_BUCKETS_S, ttft_s
    for tpot_s in (0.01, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 5):
        assert tpot_s in TOKEN_BUCKETS_S, tpot_s
    for bounds, exported in ((LATENCY_BUCKETS_S, EXPORTED_LATENCY_BOUNDS), (TOKEN_BUCKETS_S, EXPORTED_TOKEN_BOUNDS)):
        assert set(exported) <= set(bounds) and list(bounds) == sorted(set(bounds))
    telemetry = Telemetry("t")
    RouterMetrics(telemetry.meter).ttft.record(0.29, {"tenant": "a"})  # as the router's /metrics exports them
    name = "pdserve_time_to_first_token_seconds_bucket"
    exported = [float(s.labels["le"]) for f in telemetry.registry.collect() for s in f.samples if s.name == name]
    assert exported == [*LATENCY_BUCKETS_S, math.inf]
    telemetry.shutdown()


def test_a_callers_long_text_is_cut_in_spans():
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("pdserve-router", span_processor=SimpleSpanProcessor(exporter))
    with telemetry.tracer.start_as_current_span("http", attributes={"enduser.id": "u" * 8_000_000}):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.attributes["enduser.id"] == "u" * MAX_ATTRIBUTE_CHARS


def test_a_span_says_what_ended_its_operation():
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("pdserve-prefill", span_processor=SimpleSpanProcessor(exporter))
    telemetry.span("prefill.compute", 1, 2, RuntimeError("engine thread is down"), request__id="r")
    telemetry.span("prefill.queue_wait", 1, 2, asyncio.CancelledError(), request__id="r")
    telemetry.span("kv_transfer.recv", 1, 2, request__id="r")
    failed, cancelled, done = exporter.get_finished_spans()
    assert failed.status.status_code == StatusCode.ERROR and "engine thread is down" in failed.status.description
    assert [e.name for e in failed.events] == ["exception"]
    assert cancelled.status.status_code == StatusCode.UNSET and cancelled.attributes["cancelled"] is True
    assert done.status.status_code == StatusCode.UNSET and "cancelled" not in done.attributes
    assert done.attributes["request.id"] == "r"


def test_every_metric_a_router_or_worker_exports_says_what_it_measures():
    """A dashboard's author reads HELP: an empty one leaves the unit's meaning (per token? per request?) a guess."""
    telemetry = Telemetry("t")
    router = RouterMetrics(telemetry.meter)
    worker = WorkerMetrics(telemetry.meter, "w0", "prefill", lambda: {})
    histograms = (router.ttft, router.tpot, router.itl, router.e2e, worker.transfer_seconds)
    for histogram in (*histograms, worker.step_seconds, worker.step_tokens):
        histogram.record(0.1)
    counters = (router.requests, router.successes, router.prompt_tokens, router.generation_tokens, router.moves)
    counters += (router.ejections,)
    for counter in (*counters, worker.transfer_bytes):
        counter.add(1)
    families = [f for f in telemetry.registry.collect() if f.name.startswith("pdserve_")]
    assert len(families) >= 18
    assert [f.name for f in families if not f.documentation.strip()] == []
    telemetry.shutdown()


def test_a_failed_detach_of_our_own_is_still_logged(caplog) -> None:
    """Only the gRPC server interceptor's (a caller that left) is dropped: a context attached in one task and
    detached in another breaks span parenting, and says so."""
    import contextvars

    from opentelemetry import context

    from pdserve.log_setup import quiet_caller_left_errors

    quiet_caller_left_errors()
    token = context.attach(context.set_value("k", 1))
    contextvars.Context().run(context.detach, token)
    context.detach(token)
    assert [r.getMessage() for r in caplog.records if r.name == "opentelemetry.context"] == ["Failed to detach context"]


@pytest.fixture
def otlp_grpc(monkeypatch):
    """Exports to the OTLP endpoint the test sets, over gRPC, only as the service stops (the batch delay is long)."""
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    return lambda port: monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")


def stopped_in_s(service: str) -> float:
    telemetry = Telemetry(service)
    with telemetry.tracer.start_as_current_span("last"):
        pass
    start = time.monotonic()
    telemetry.shutdown()
    return time.monotonic() - start


def test_a_stop_waits_for_a_collector_that_is_down_at_most_the_final_export_bound(otlp_grpc):
    """Before, 7.3 s: the OTLP exporter's retries (1 + 2 + 4 s of backoff) in the final export, in every pod's stop."""
    otlp_grpc(free_port())  # nothing listens there
    assert stopped_in_s("test-stop") < FINAL_EXPORT_S + 2.0


def test_a_stop_still_exports_its_last_spans_to_a_collector_that_is_up(otlp_grpc):
    with serving_collector() as collector:
        otlp_grpc(collector.port)
        stopped_in_s("test-stop")
        assert [(svc, s.name) for svc, s in collector.spans] == [("test-stop", "last")]


def test_every_services_metrics_include_its_process():
    """A worker's (and the router's) /metrics has the process collector's series: memory, CPU, start time."""
    telemetry = Telemetry("pdserve-decode")
    got = {s.name: s.value for f in telemetry.registry.collect() for s in f.samples}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds"):
        assert got.get(name, 0) > 0, name
    telemetry.shutdown()


def test_a_workers_waiting_sequences_are_a_gauge_beside_its_running_ones():
    """vLLM's num_requests_waiting: sequences queued for the batch (new, or preempted to be recomputed)."""
    telemetry = Telemetry("t")
    WorkerMetrics(telemetry.meter, "w0", "decode", lambda: {"running": 2, "waiting": 3})
    got = {
        (s.name, s.labels["worker_id"], s.labels["role"]): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name in ("pdserve_running_sequences", "pdserve_waiting_sequences")
    }
    assert got == {("pdserve_running_sequences", "w0", "decode"): 2, ("pdserve_waiting_sequences", "w0", "decode"): 3}
    telemetry.shutdown()


def test_a_workers_speed_factor_is_a_gauge_read_when_scraped():
    """The live correction the router prices a worker by: one priced slow gets no traffic at low load."""
    telemetry = Telemetry("t")
    speed = [1.0]
    WorkerMetrics(telemetry.meter, "p1", "prefill", lambda: {}).track_speed(lambda: speed[0])
    speed[0] = 2.5  # corrected after the gauge was made: the scrape reads it now

    def scraped() -> dict[tuple[str, str], float]:
        samples = (s for f in telemetry.registry.collect() for s in f.samples)
        return {(s.labels["worker_id"], s.labels["role"]): s.value for s in samples
                if s.name == "pdserve_worker_speed_factor"}  # fmt: skip

    assert scraped() == {("p1", "prefill"): 2.5}
    telemetry.shutdown()


def test_a_kv_transfer_is_timed_in_buckets_from_under_a_millisecond_and_failures_count_from_zero():
    """A loopback or NVLink transfer takes well under 5 ms, which the request buckets would lump into their first;
    each failure reason is exported at 0 before any failure, so a rate sees the first one."""
    telemetry = Telemetry("t")
    worker = WorkerMetrics(telemetry.meter, "p0", "prefill", lambda: {})
    worker.transfer_seconds.record(0.0003, worker.labels)
    worker.transfer_failed("peer_gone")
    samples = [s for f in telemetry.registry.collect() for s in f.samples]
    buckets = {s.labels["le"]: s.value for s in samples if s.name == "pdserve_kv_transfer_seconds_bucket"}
    assert buckets["0.0005"] == 1 and buckets["0.001"] == 1 and float(min(buckets, key=float)) == 0.0005
    assert ClusterConfig.kv_transfer_timeout_s in TRANSFER_BUCKETS_S  # a transfer any longer fails
    failures = {s.labels["reason"]: s.value for s in samples if s.name == "pdserve_kv_transfer_failures_total"}
    assert failures == {**dict.fromkeys(KV_TRANSFER_FAILURE_REASONS, 0.0), "peer_gone": 1.0}
    telemetry.shutdown()


def test_each_engine_step_is_timed_from_a_millisecond_and_its_batch_counted_by_worker():
    """Step latency and batch fill per worker (vLLM's iteration tokens and step times): a decode step of a small
    batch on a GPU takes about a millisecond, which the request buckets (from 5 ms) would lump into their first."""
    telemetry = Telemetry("t")
    worker = WorkerMetrics(telemetry.meter, "d0", "decode", lambda: {})
    worker.stepped(48, 0.0008)
    worker.stepped(1, 2.0)
    samples = [s for f in telemetry.registry.collect() for s in f.samples if s.labels.get("worker_id") == "d0"]
    seconds = {s.labels["le"]: s.value for s in samples if s.name == "pdserve_engine_step_seconds_bucket"}
    assert (seconds["0.001"], seconds["1"], seconds["2.5"]) == (1, 1, 2) and min(STEP_BUCKETS_S) == 0.001
    tokens = {s.labels["le"]: s.value for s in samples if s.name == "pdserve_engine_step_tokens_bucket"}
    assert (tokens["1"], tokens["32"], tokens["64"]) == (1, 1, 2)
    assert {s.labels["role"] for s in samples if s.name.startswith("pdserve_engine_step_")} == {"decode"}
    telemetry.shutdown()


def test_a_workers_request_queue_prefill_and_preemption_wait_times_are_bucketed_as_the_routers_ttft():
    """Queue time is read against TTFT bound for bound (a prefill queue eating the TTFT SLO shows at the same `le`);
    every observation a step reports is recorded, under the worker's own labels."""
    telemetry = Telemetry("t")
    worker = WorkerMetrics(telemetry.meter, "p0", "prefill", lambda: {})
    worker.requests_timed([0.004, 2.2], [0.29, 0.31], [])
    worker.requests_timed([40.0], [], [7.0])
    samples = [s for f in telemetry.registry.collect() for s in f.samples if s.labels.get("worker_id") == "p0"]
    buckets: dict[str, dict[float, float]] = {}
    for name, count in (
        ("pdserve_request_queue_time_seconds", 3),
        ("pdserve_request_prefill_time_seconds", 2),
        ("pdserve_preemption_wait_seconds", 1),
    ):
        buckets[name] = {float(s.labels["le"]): s.value for s in samples if s.name == f"{name}_bucket"}
        assert list(buckets[name]) == [*LATENCY_BUCKETS_S, math.inf]
        assert [s.value for s in samples if s.name == f"{name}_count"] == [count]
        assert {s.labels["role"] for s in samples if s.name.startswith(name)} == {"prefill"}
    queue, prefill, requeue = buckets.values()
    assert (queue[0.005], queue[2], queue[2.5], queue[40]) == (1, 1, 2, 3)
    assert (prefill[0.25], prefill[0.3], prefill[0.5]) == (0, 1, 2)
    assert (requeue[5], requeue[7.5]) == (0, 1)
    telemetry.shutdown()


def test_worker_replacements_count_from_zero_for_each_role_of_the_fleet():
    """The chart's alert reads increase(pdserve_worker_replacements_total[1h]): a series born at 1 would hide the
    first replacement since the controller started."""
    telemetry = Telemetry("t")
    SupervisionMetrics(telemetry.meter, [Role.PREFILL, Role.PREFILL, Role.DECODE])
    samples = [s for f in telemetry.registry.collect() for s in f.samples]
    got = {s.labels["role"]: s.value for s in samples if s.name == "pdserve_worker_replacements_total"}
    assert got == {"prefill": 0.0, "decode": 0.0}
    telemetry.shutdown()
