"""What tests read of a running cluster from outside, as an operator would: its traces (a small OTLP trace
receiver in the test process), its Prometheus metrics and `pdserve status --json`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps every span with its resource's service.name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]

    def trace_of(self, client_request_id: str) -> bytes | None:
        """The trace of the request a client sent with this request_id (the router keys it by its own id)."""
        with self.lock:
            for svc, s in self.spans:
                if svc == "pdserve-router" and any(
                    a.key == "request.client_id" and a.value.string_value == client_request_id for a in s.attributes
                ):
                    return s.trace_id
        return None


@contextmanager
def serving_collector() -> Iterator[Collector]:
    """A Collector listening on a free loopback port (`.port`), for OTEL_EXPORTER_OTLP_ENDPOINT."""
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    c.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield c
    finally:
        server.stop(0)


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def status_json(address: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--addr", address, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
