"""The WorkerControl service every worker serves: its `Drain`, as the router's `pdserve drain` reaches it, and
`CheckPeer`, which a router's readiness asks (services/router/peer_check.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict

import grpc

from pdserve.cluster.drain import DrainReport, check_drain_timeout
from pdserve.rpc.server import Server
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc

Drain = Callable[[float], Awaitable[DrainReport]]


class WorkerControlServicer(worker_pb2_grpc.WorkerControlServicer):
    def __init__(self, drain: Drain, worker_id: str) -> None:
        self._drain = drain
        self._worker_id = worker_id

    async def CheckPeer(  # noqa: N802 (gRPC method name)
        self, request: wpb.CheckPeerRequest, context: grpc.aio.ServicerContext
    ) -> wpb.CheckPeerReply:
        """Nothing to do: reaching here, past the cluster-auth interceptor, is the answer."""
        return wpb.CheckPeerReply(worker_id=self._worker_id)

    async def Drain(  # noqa: N802 (gRPC method name)
        self, request: wpb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> wpb.DrainReport:
        check_drain_timeout(request.timeout_s)
        return wpb.DrainReport(**asdict(await self._drain(request.timeout_s)))


def add_control_service(server: Server, drain: Drain, worker_id: str) -> None:
    servicer = WorkerControlServicer(drain, worker_id)
    server.add(
        lambda s: worker_pb2_grpc.add_WorkerControlServicer_to_server(servicer, s),
        [wpb.DESCRIPTOR.services_by_name["WorkerControl"].full_name],
    )
