"""Internal RPCs accept only cluster peers: a server interceptor that refuses calls without the cluster's RPC
token (UNAUTHENTICATED), and a client interceptor that adds it to every call on an internal channel. Health
stays open, so a load balancer or the launcher can probe a worker without the secret."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdserve.security.cluster_secret import CLUSTER_AUTH_KEY, ClusterSecret

OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"


class ClusterAuthServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, cluster: ClusterSecret) -> None:
        self._cluster = cluster

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS_PREFIX):
            return handler
        presented = dict(details.invocation_metadata or ()).get(CLUSTER_AUTH_KEY)
        if self._cluster.check_rpc_token(presented if isinstance(presented, str) else None):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "internal RPC: not a cluster peer")

    # No deserializer: a non-peer's message stays bytes, never parsed (16 MiB of token ids take ~40 ms to parse).
    kinds = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kinds)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kinds)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse, **kinds)
    return grpc.unary_unary_rpc_method_handler(refuse, **kinds)


class _AddToken:
    def __init__(self, cluster: ClusterSecret) -> None:
        self._pair = (CLUSTER_AUTH_KEY, cluster.rpc_token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


def cluster_client_interceptors(cluster: ClusterSecret) -> list[Any]:
    """What an internal channel adds to every call; nothing without a secret."""
    return [_UnaryUnary(cluster), _UnaryStream(cluster)] if cluster.enabled else []
