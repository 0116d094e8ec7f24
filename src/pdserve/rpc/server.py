"""gRPC server and channel set-up shared by the router and the workers."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pdserve.addresses import candidate_ports, join
from pdserve.config import MAX_MESSAGE_BYTES
from pdserve.rpc.cluster_auth import ClusterAuthServerInterceptor, cluster_client_interceptors
from pdserve.rpc.credentials import (
    ClientCredentials,
    ServerTLS,
    add_port,
    internal_client_credentials,
    make_channel,
)
from pdserve.rpc.errors import ErrorMappingInterceptor
from pdserve.rpc.request_deadline import RequestMessageDeadline
from pdserve.rpc.stream_writer import StreamWriter
from pdserve.security.cluster_secret import ClusterSecret

_MESSAGE_SIZES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A stopped or partitioned peer answers no HTTP/2 ping: both ends ping every KEEPALIVE_TIME_MS, and a ping not
# answered within KEEPALIVE_TIMEOUT_MS fails every call on that connection (UNAVAILABLE), instead of a stream
# that waits forever for a first token. Pings go on while a stream sends no data (a long prefill) and while no
# call is open, and a server accepts them that often. gRPC core (1.85) times a ping out by ping_timeout_ms (60 s
# by default), not by keepalive_timeout_ms alone: both are set.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A request's metadata (headers) past this is refused by gRPC itself, RESOURCE_EXHAUSTED. By default gRPC refuses
# at random between a soft (8 KiB) and a hard (16 KiB) limit, so the same request passed or failed by chance; one
# limit makes the answer the same every time.
MAX_METADATA_BYTES = 16 * 1024
_METADATA_SIZE = [
    ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
]
# A connection that has not finished its handshake (TLS: never sent a ClientHello) within this is closed, as the
# HTTP API closes one whose request head is not in within 10 s; gRPC's default, 120 s, let idle connections hold
# the port's file descriptors unauthenticated.
HANDSHAKE_TIMEOUT_MS = 10_000
# A call's request message must be in within this of the call's start, as the HTTP API's body within 30 s of its
# head (the largest message, 16 MiB, at 0.6 MB/s); a call without one held its stream for ever.
REQUEST_MESSAGE_TIMEOUT_S = 30.0
CHANNEL_OPTIONS = [*_MESSAGE_SIZES, *_KEEPALIVE]
SERVER_OPTIONS = [
    *_MESSAGE_SIZES,
    *_METADATA_SIZE,
    *_KEEPALIVE,
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    # gRPC sets SO_REUSEPORT by default: a second server on a taken fixed port would bind it too and silently
    # take half of its connections. Off, a taken port is an error (and `port_span` moves on to the next).
    ("grpc.so_reuseport", 0),
]


class Server:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`), reflection and the error interceptor.
    It binds `host` (a wildcard allowed) and its `address` names `advertise_host` (default: `host`), the one
    peers dial; every server in pdserve is made here, so transport settings apply to all of them at once. A fixed
    `port` that is taken moves on to the next of `port_span` ports (several workers on one host share a first
    port); port 0 is any free port.
    `reflection=False` leaves server reflection off: a public port need not list its services to a stranger.
    `tls`: serve TLS (and require client certificates when it names a client CA); None: plaintext.
    `cluster`: an internal server's cluster secret; calls without its token are refused (health stays open).
    `max_connection_age_s`: send each connection a GOAWAY after this long (None: never); its open calls run on
    to their end (no grace bound), new ones open a new connection, which a load balancer may place elsewhere.
    `checked_by_handler`: methods whose handlers answer a request that does not parse (ErrorMappingInterceptor).
    `max_receive_message_bytes`: a smaller bound on the messages it takes (a public port: what a valid request can
    hold, since gRPC buffers a message whole before any handler checks its caller); what it sends keeps the bound.
    `request_timeout_s`: a unary-request call whose message is not in this long after its start ends
    DEADLINE_EXCEEDED (request_deadline.py)."""

    def __init__(
        self,
        host: str,
        port: int,
        interceptors: Sequence[Any] = (),
        reflection: bool = True,
        tls: ServerTLS | None = None,
        cluster: ClusterSecret | None = None,
        inner: Sequence[Any] = (),
        advertise_host: str | None = None,
        port_span: int = 1,
        max_connection_age_s: float | None = None,
        checked_by_handler: Iterable[str] = (),
        max_receive_message_bytes: int | None = None,
        request_timeout_s: float = REQUEST_MESSAGE_TIMEOUT_S,
    ) -> None:
        # The request message's deadline outermost (a call without its message runs nothing else), then tracing
        # interceptors, so their spans see the status the error mapping chose and end
        # after the stream writer has closed the handler; `inner` ones (a worker's drain gate) inside the mapping,
        # so the typed errors they raise get their status.
        auth = [ClusterAuthServerInterceptor(cluster)] if cluster is not None and cluster.enabled else []
        mapping = ErrorMappingInterceptor(tuple(checked_by_handler))
        chain = [RequestMessageDeadline(request_timeout_s), *interceptors, StreamWriter(), *auth, mapping, *inner]
        age_ms = None if max_connection_age_s is None else round(max_connection_age_s * 1000)
        age = [] if age_ms is None else [("grpc.max_connection_age_ms", age_ms)]
        options = [*SERVER_OPTIONS, *age]
        if max_receive_message_bytes is not None:
            receive = "grpc.max_receive_message_length"
            options = [o for o in options if o[0] != receive] + [(receive, max_receive_message_bytes)]
        self._server = grpc.aio.server(interceptors=chain, options=options)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = _bind(self._server, host, port, port_span, tls)
        self.address = join(advertise_host or host, self.port)
        self._reflection = reflection
        self._service_names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]

    def add(self, register: Callable[[grpc.aio.Server], None], service_names: Iterable[str]) -> None:
        register(self._server)
        self._service_names.extend(service_names)

    async def start(self) -> None:
        if self._reflection:
            reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME], self._server)
        # grpc's HealthServicer answers SERVING for "" from the start; a readiness probe must not pass while a
        # worker still warms up, so "" too is NOT_SERVING until set_serving(True).
        await self.set_serving(False)
        await self._server.start()

    async def set_serving(self, serving: bool, held: Collection[str] = ()) -> None:
        """Every service's health, and the server's (""); those `held` are NOT_SERVING whatever `serving` says."""
        for name in ("", *self._service_names):
            up = serving and name not in held
            status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        await self._server.stop(grace_s)

    async def wait(self) -> None:
        await self._server.wait_for_termination()


def _bind(server: grpc.aio.Server, host: str, port: int, span: int, tls: ServerTLS | None) -> int:
    for candidate in candidate_ports(port, span):
        try:
            if bound := add_port(server, join(host, candidate), tls):
                return bound
        except RuntimeError:  # gRPC raises or returns 0 for a port it cannot bind, by version
            pass
    raise OSError(f"could not bind {join(host, port)}" + (f" nor the {span - 1} ports after it" if span > 1 else ""))


def channel(
    address: str, interceptors: Sequence[Any] | None = None, credentials: ClientCredentials | None = None
) -> grpc.aio.Channel:
    """With keepalive: a call to a peer that stopped answering fails within about 15 s.
    `interceptors`: a service's tracing client interceptors, so the trace context rides the metadata.
    `credentials`: TLS and client certificate (rpc/credentials.py); None: plaintext."""
    return make_channel(address, CHANNEL_OPTIONS, interceptors or None, credentials)


def internal_channel(address: str, interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
    """A channel to another pdserve server of this cluster: every call carries the cluster's RPC token, over
    mTLS when internal TLS is configured."""
    cluster = ClusterSecret.from_env()
    return channel(address, [*interceptors, *cluster_client_interceptors(cluster)], internal_client_credentials())
