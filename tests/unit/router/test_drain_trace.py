"""A drain the router asks of a worker (`pdserve drain`, Admin/DrainWorkers) is one trace: the worker's
WorkerControl/Drain server span is a child of the router's call to it, under the Admin call's span. Without the
router's tracing interceptors on that channel, the worker's span started a trace of its own."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.config import RouterConfig
from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.rpc.server import Server
from pdserve.telemetry import Telemetry
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc, worker_pb2_grpc
from pdserve.v1 import worker_pb2 as wpb
from services.router.server import start_router
from tests.unit.router.router_builder import worker

pytestmark = pytest.mark.timeout(60)


class DrainsAtOnce(worker_pb2_grpc.WorkerControlServicer):
    async def Drain(self, request: wpb.DrainRequest, context: grpc.aio.ServicerContext) -> wpb.DrainReport:  # noqa: N802
        return wpb.DrainReport(worker_id="d0")


async def test_a_drain_the_router_asks_is_one_trace_from_the_admin_call_to_the_worker(monkeypatch) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    worker_side = Telemetry("pdserve-decode", span_processor=SimpleSpanProcessor(exporter))
    router_side = Telemetry("pdserve-router", span_processor=SimpleSpanProcessor(exporter))
    control = Server("127.0.0.1", 0, worker_side.server_interceptors())
    control.add(lambda s: worker_pb2_grpc.add_WorkerControlServicer_to_server(DrainsAtOnce(), s), [])
    await control.start()
    registry = InMemoryRegistry()
    registry.publish(worker("d0", "decode", address=control.address))
    router, _ = await start_router(
        "tiny-random", registry, InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0, router_side
    )
    try:
        async with grpc.aio.insecure_channel(router.address) as ch:
            answer = await admin_pb2_grpc.AdminStub(ch).DrainWorkers(
                apb.DrainWorkersRequest(worker_ids=["d0"], timeout_s=1), timeout=10
            )
    finally:
        await router.stop(None)
        await control.stop(None)
    assert [(w.id, w.drained) for w in answer.workers] == [("d0", True)]
    spans = exporter.get_finished_spans()
    (drained,) = [s for s in spans if s.resource.attributes["service.name"] == "pdserve-decode"]
    assert "WorkerControl/Drain" in drained.name
    (admin,) = [s for s in spans if "Admin/DrainWorkers" in s.name]
    by_id = {s.context.span_id: s for s in spans}
    assert drained.context.trace_id == admin.context.trace_id
    parent = by_id[drained.parent.span_id]  # the router's client span of its call to the worker
    assert (
        parent.resource.attributes["service.name"] == "pdserve-router"
        and parent.parent.span_id == admin.context.span_id
    )
    router_side.shutdown()
    worker_side.shutdown()
