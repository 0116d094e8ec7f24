"""Tracing, metrics and structured logs for one service (router, prefill or decode worker).

One `Telemetry` per service, each with its own tracer provider (resource `service.name`) and its own
Prometheus registry, so several services can live in one process (tests) without mixing. Spans are
exported only when the standard OTEL_* variables ask for it; the sampler and batch settings are the
SDK's own OTEL_* handling. Trace context rides gRPC metadata: OpenTelemetry's client interceptors put it there,
and each server's call span (rpc/server_spans.py) takes it.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from pdserve import env
from pdserve.errors import (
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    RouterDrainingError,
    UnauthenticatedError,
)
from pdserve.redaction import recorded_text
from pdserve.rpc.server_spans import ServerSpans

# Seconds: first tokens and whole requests (TTFT, e2e) span ms to minutes; per-token gaps ms to seconds. An SLO is
# read from a histogram (a burn-rate alert) only at a bucket bound: the common ones (TTFT 100, 200, 300, 500 ms, 1,
# 2, 3, 5, 10 s; TPOT 10, 20, 25, 30, 50, 75, 100 ms...) are bounds. A bound once exported is never removed: a query
# naming its `le` would silently read nothing.
LATENCY_BUCKETS_S = (
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.75, 1, 1.5, 2, 2.5, 3),
    *(5, 7.5, 10, 15, 20, 30, 40, 60, 80, 160),
)
# Per-token gaps up to the router's 5 s stall bound (past it a stream moves), and a stalled one's 10 s.
TOKEN_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.08, 0.1),
    *(0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1, 2, 2.5, 5, 10),
)
# One prompt's KV: well under a millisecond over loopback or NVLink, up to seconds for a long prompt over a slow
# network; the last edge is the default transfer timeout (a transfer that takes longer fails).
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# One engine step: a decode step of a small batch takes ~1 ms on a GPU, a long prefill chunk on a CPU seconds.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
# Tokens in one step's batch: 1 (a lone decode) up to max_num_batched_tokens, powers of two as vLLM's.
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A span attribute's longest value: callers' text (an HTTP `user`, an error naming a request) stays far under an
# OTLP collector's 4 MiB message limit, which one oversized span would break for every span batched with it.
MAX_ATTRIBUTE_CHARS = 4096
# A stopping service's last spans get this long to reach the collector: with the collector down, the OTLP exporters'
# retries (1 + 2 + 4 s of backoff) held every stop ~7 s, inside a pod's termination grace.
FINAL_EXPORT_S = 2.0
# Beside /metrics where a service serves a liveness check (the controller: its supervision loop's progress).
HEALTH_PATH = "/healthz"
# A metrics connection's idle limit: its server runs a thread per connection, which one opened and left silent
# (or a trickle of them) would otherwise hold forever; a scrape sends its request at once.
METRICS_READ_TIMEOUT_S = 10.0

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)


def default_span_processors() -> list[SpanProcessor]:
    """What the OTEL_* environment asks for, one processor per exporter; none when it asks for nothing."""
    processors: list[SpanProcessor] = []
    for kind, protocol in env.otel_traces_exporters():
        if kind == "console":
            processors.append(BatchSpanProcessor(ConsoleSpanExporter()))
        elif (protocol or env.otel_traces_protocol()) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            processors.append(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

            processors.append(BatchSpanProcessor(HTTPSpanExporter()))
    return processors


# Health checks (a kubelet's probes, the router's of its workers, `pdserve status`) and a router's check of its
# cluster credentials (`CheckPeer`, to a few workers every 10 s: services/router/peer_check.py) are no request's hop:
# each would be a trace of its own, every few seconds from every pod.
_PEER_CHECK = filters.all_of(filters.service_name("pdserve.v1.WorkerControl"), filters.method_name("CheckPeer"))
_TRACED_CALLS = filters.negate(filters.any_of(filters.health_check(), _PEER_CHECK))


class Telemetry:
    """One service's tracer, meter, gRPC interceptors and /metrics endpoint.

    `span_processor` replaces the environment's choice (tests pass a SimpleSpanProcessor around an
    InMemorySpanExporter). With neither, tracing is off: no spans, no interceptors (measured: recording
    spans nobody exports cost ~1.8 ms per request in the router). `pdserve up` hands its OTEL_* environment
    to every worker, so a cluster traces everywhere or nowhere.
    """

    def __init__(self, service: str, span_processor: SpanProcessor | None = None, enabled: bool = True) -> None:
        self.service = service
        self.enabled = enabled
        self.registry = CollectorRegistry()
        self._http: Any = None
        processors = ([span_processor] if span_processor else default_span_processors()) if enabled else []
        self.tracing = bool(processors)
        self._exporters = [p.span_exporter for p in processors if isinstance(p, BatchSpanProcessor)]
        resource = Resource.create({SERVICE_NAME: service})
        self.tracer_provider: Any = trace.NoOpTracerProvider()
        if processors:
            limits = SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS)
            self.tracer_provider = TracerProvider(resource=resource, span_limits=limits)
            for processor in processors:
                self.tracer_provider.add_span_processor(processor)
        self.meter_provider: Any = metrics.NoOpMeterProvider()
        if enabled:  # disabled: the baseline the overhead is measured against
            ProcessCollector(registry=self.registry)  # process_*: memory, CPU seconds, start time, open fds
            reader = PrometheusMetricReader(registry=self.registry)
            self.meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
        self.tracer = self.tracer_provider.get_tracer("pdserve")
        self.meter = self.meter_provider.get_meter("pdserve")

    def server_interceptors(self) -> list[Any]:
        if not self.tracing:
            return []
        return [ServerSpans(self.tracer, _TRACED_CALLS)]

    def client_interceptors(self) -> list[Any]:
        if not self.tracing:
            return []
        return list(aio_client_interceptors(tracer_provider=self.tracer_provider, filter_=_TRACED_CALLS))

    def serve_metrics(self, host: str, port: int = 0, health: Callable[[], str | None] | None = None) -> int:
        """Serves this service's metrics at http://host:port/metrics (port 0: a free one); returns the port. With
        `health`, also HEALTH_PATH: 200 while it returns None, else 503 with what it returned (the server runs on a
        thread of its own, so /metrics answering says nothing of the service's own loop)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http.RequestHandlerClass = _timed(self._http.RequestHandlerClass)
        if health is not None:  # each request asks the server for its app: from here on, every one gets this
            self._http.set_app(_with_health(self._http.get_app(), health))
        return int(self._http.server_port)

    def span(
        self, name: str, start_ns: int, end_ns: int, failed: BaseException | None = None, /, **attributes: Any
    ) -> None:
        """A span measured after the fact (queue waits: their start is known only once they end); `failed`: what
        ended the operation instead of its result (`mark_ended_by`)."""
        span = self.tracer.start_span(name, start_time=start_ns, attributes=_attrs(attributes))
        mark_ended_by(span, failed)
        span.end(end_time=max(end_ns, start_ns))

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self.tracing:
            self._shutdown_tracing()
        if self.enabled:
            self.meter_provider.shutdown()

    def _shutdown_tracing(self) -> None:
        """The provider's shutdown exports the spans left; past FINAL_EXPORT_S the exporters are shut down, which
        cuts a retry's backoff short (what is still queued is lost, as a collector that is down loses it anyway)."""
        cut = threading.Timer(FINAL_EXPORT_S, lambda: [e.shutdown() for e in self._exporters])
        cut.daemon = True
        cut.start()
        try:
            self.tracer_provider.shutdown()
        finally:
            cut.cancel()


# What a request is answered for what it asked or may ask (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED,
# PERMISSION_DENIED; HTTP 4xx), or told to ask elsewhere (a draining router): no failure of this service, so no
# ERROR on its spans (OpenTelemetry's convention for server spans), only a `refused` attribute saying why.
# The caller's own doing, whenever it ends a request; with a shed or a draining router, answers to the caller.
CALLER_FAULTS = (InvalidRequestError, UnauthenticatedError, PermissionDeniedError)
CALLER_ANSWERS = (*CALLER_FAULTS, OverloadedError, RouterDrainingError)


@contextmanager
def step_span(tracer: trace.Tracer, name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span for one step of a request, ERROR only when the service failed there (`mark_ended_by`), not when it
    answered the caller: error rates read from span status then do not rise with load shedding or client bugs."""
    with tracer.start_as_current_span(
        name, attributes=_attrs(attributes), record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as e:
            mark_ended_by(span, e)
            raise


def mark_ended_by(span: trace.Span, error: BaseException | None) -> None:
    """What ended a span's operation early, on the span: a failure as ERROR with its exception; the caller's cancel
    (a cancelled task, a stream closed under it) as `cancelled` and an answer to the caller as `refused`, neither
    an error of this service's."""
    if error is None:
        return
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        span.set_attribute("cancelled", True)
        return
    if isinstance(error, CALLER_ANSWERS):
        span.set_attribute("refused", f"{type(error).__name__}: {recorded_text(error)}")
        return
    mark_failed(span, error)


def mark_failed(span: trace.Span, error: BaseException) -> None:
    """ERROR with the exception, whatever it is: for an error that broke what the caller was already given (a stream
    its first events reached), a shed included. Its type is OpenTelemetry's `error.type`, which a
    backend groups failures by (the exception event's text is unbounded)."""
    span.set_attribute("error.type", type(error).__qualname__)
    span.record_exception(error)
    span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")


def _timed(handler: type[Any]) -> type[Any]:
    """`handler` with METRICS_READ_TIMEOUT_S on each connection's socket (socketserver applies its `timeout`). A
    connection it ends just closes: wsgiref's handler lets the timeout out, which socketserver would print to
    stderr as a traceback, one per idle connection (log lines anyone who opens connections could write)."""

    class TimedHandler(handler):  # type: ignore[misc,valid-type]
        timeout = METRICS_READ_TIMEOUT_S

        def handle(self) -> None:
            try:
                super().handle()
            except TimeoutError:
                self.close_connection = True

    return TimedHandler


def _with_health(app: WSGIApplication, health: Callable[[], str | None]) -> WSGIApplication:
    """`app` (prometheus_client's /metrics), with HEALTH_PATH answered from `health`."""

    def serve(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return app(environ, start_response)
        problem = health()
        start_response("503 Service Unavailable" if problem else "200 OK", [("Content-Type", "text/plain")])
        return [f"{problem or 'ok'}\n".encode()]

    return serve


def _attrs(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("__", "."): v for k, v in attributes.items() if v is not None}


def now_ns() -> int:
    return time.time_ns()
