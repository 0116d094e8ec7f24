"""The error interceptor on a real grpc.aio server: a bug's text never reaches the caller, only an id that the
server's log holds beside it; the auth errors get their own codes, and a cluster peer's refusal of this process is a
peer it cannot use on every hop; reflection is a switch."""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.errors import (
    AbandonedError,
    ClusterAuthError,
    InvalidRequestError,
    KVMismatchError,
    OverloadedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.rpc.cluster_auth import cluster_client_interceptors
from pdserve.rpc.errors import error_from_rpc
from pdserve.rpc.server import Server, channel
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

SECRET = "/home/alice/.ssh/id_rsa other-tenant-prompt"
PREFILL = "prefill worker 10.1.2.3:50062"
QUOTED = 'invalid regex "SECRET-CANARY-123([" ✓'


class Raising(generate_pb2_grpc.GenerationServicer):
    async def Generate(self, request: pb.GenerateRequest, context: object) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        if request.prompt == "auth":
            raise UnauthenticatedError("no API key")
        if request.prompt == "priority":
            raise PermissionDeniedError("priority", "above this key's cap")
        if request.prompt == "prefill refused":  # a decode worker whose prefill call was refused
            raise ClusterAuthError(f"{PREFILL}: internal RPC: not a cluster peer (UNAUTHENTICATED)")
        if request.prompt == "prefill of other weights":  # a decode worker's prefill worker refused its KV layout
            raise KVMismatchError(f"{PREFILL}: KV layout mismatch: decode runs (model, block size) ('a', 16)")
        if request.prompt == "prefill abandoned":  # the router ended the attempt while its decode worker waited
            raise AbandonedError(f"{PREFILL}: the router ended this attempt before its first token (UNAVAILABLE)")
        if request.prompt == "prefill gone":
            raise UnavailableError(f"{PREFILL}: connection refused (UNAVAILABLE)")
        if request.prompt == "full":
            raise OverloadedError("every decode worker's batch is full", retry_after_ms=250)
        if request.prompt == "bad":
            raise InvalidRequestError("sampling.max_tokens", "must be >= 0")
        if request.prompt == "no threads":  # CPython's error where a thread does not start
            raise RuntimeError("can't start new thread")
        if request.prompt == "no memory":
            raise MemoryError()
        if request.prompt.startswith("errno "):  # an OSError whose text names a file
            code = int(request.prompt.split()[1])
            raise OSError(code, os.strerror(code), SECRET)
        if request.prompt == "quoting":  # a message that quotes the request back to its caller
            raise InvalidRequestError("sampling.regex", f"does not compile: {QUOTED}", "does not compile")
        raise RuntimeError(SECRET)
        yield pb.GenerateResponse()


async def _serve(reflection: bool, cluster: ClusterSecret | None = None) -> Server:
    server = Server("127.0.0.1", 0, reflection=reflection, cluster=cluster)
    server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(Raising(), s), ["pdserve.v1.Generation"])
    await server.start()
    return server


async def _call(address: str, prompt: str, cluster: ClusterSecret | None = None) -> grpc.aio.AioRpcError:
    async with channel(address, cluster_client_interceptors(cluster) if cluster else None) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt=prompt)):
                pass
    return caught.value


async def test_internal_carries_an_error_id_and_never_the_exception_text(caplog: pytest.LogCaptureFixture) -> None:
    server = await _serve(reflection=True)
    try:
        with caplog.at_level(logging.ERROR):
            e = await _call(server.address, "boom")
        assert e.code() == grpc.StatusCode.INTERNAL
        assert "alice" not in e.details() and "RuntimeError" not in e.details()
        error_id = re.search(r"error id ([0-9a-f]{16})", e.details()).group(1)
        logged = [r for r in caplog.records if getattr(r, "error_id", None) == error_id]
        assert logged and SECRET in str(logged[0].exc_info[1])
        assert (await _call(server.address, "auth")).code() == grpc.StatusCode.UNAUTHENTICATED
        denied = await _call(server.address, "priority")
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and denied.details().startswith("priority:")
    finally:
        await server.stop(None)


async def test_each_promise_has_its_code_shed_with_its_retry_hint() -> None:
    """RESOURCE_EXHAUSTED and a pushback trailer: a later retry can succeed; INVALID_ARGUMENT naming the field: it
    never will; UNAVAILABLE: the cluster could not recover by itself."""
    server = await _serve(reflection=False)
    try:
        shed = await _call(server.address, "full")
        assert shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("grpc-retry-pushback-ms", "250") in tuple(shed.trailing_metadata() or ())
        bad = await _call(server.address, "bad")
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.details().startswith("sampling.max_tokens:")
        assert (await _call(server.address, "prefill gone")).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("prompt", "resource"),
    [
        ("no threads", "threads"),
        ("no memory", "memory"),
        (f"errno {errno.EMFILE}", "file descriptors"),
        (f"errno {errno.ENFILE}", "file descriptors"),
        (f"errno {errno.ENOMEM}", "memory"),
        (f"errno {errno.ECONNREFUSED}", None),  # no exhaustion: a bug, as any error a handler did not expect
    ],
)
async def test_a_host_out_of_threads_memory_or_descriptors_is_unavailable_naming_the_resource_alone(
    prompt: str, resource: str | None
) -> None:
    """Another worker may serve: the router moves the request and ejects this one a while, where INTERNAL, a bug's
    code, reached the caller as it was, never retried. An OSError's text may name a file: only the log has it."""
    server = await _serve(reflection=False)
    try:
        e = await _call(server.address, prompt)
    finally:
        await server.stop(None)
    assert "alice" not in e.details()
    if resource is None:
        assert e.code() == grpc.StatusCode.INTERNAL
        return
    assert e.code() == grpc.StatusCode.UNAVAILABLE and e.details().startswith(f"out of {resource} on its host")
    assert type(error_from_rpc(e, PREFILL)) is UnavailableError


async def test_a_refusal_quoting_the_request_is_recorded_without_the_quote_on_the_next_hop_too() -> None:
    """The caller beyond the next hop is told all of it; the next hop's log lines and spans keep what this one's
    would (InvalidRequestError.recorded), so a worker's quote of the request does not reach the router's trace."""
    server = await _serve(reflection=False)
    try:
        error = error_from_rpc(await _call(server.address, "quoting"), "decode worker d0")
        plain = error_from_rpc(await _call(server.address, "bad"), "decode worker d0")
    finally:
        await server.stop(None)
    assert isinstance(error, InvalidRequestError) and QUOTED in str(error)
    assert error.recorded == "request: decode worker d0: sampling.regex: does not compile"
    assert isinstance(plain, InvalidRequestError) and plain.recorded == str(plain)


@pytest.mark.parametrize("on", [True, False])
async def test_reflection_is_a_switch(on: bool) -> None:
    server = await _serve(reflection=on)
    try:
        async with channel(server.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            if on:
                replies = [r async for r in stub.ServerReflectionInfo(iter([ask]))]
                names = [s.name for s in replies[0].list_services_response.service]
                assert "pdserve.v1.Generation" in names
            else:  # nothing written: a write racing the server's UNIMPLEMENTED may fail INTERNAL (grpc/grpc#36066)
                assert await stub.ServerReflectionInfo(timeout=10).code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


async def test_a_message_that_does_not_parse_is_invalid_argument_without_parser_text() -> None:
    server = await _serve(reflection=False)
    try:
        async with channel(server.address) as ch:
            call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=bytes)
            for raw in (b"\x12\x02\xff\xfe", b"\xff\xff\xff", b"\x0a\x05ab"):  # bad UTF-8, corrupt, truncated
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in call(raw):
                        pass
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details().startswith("request:") and "DecodeError" not in caught.value.details()
    finally:
        await server.stop(None)


async def test_a_peer_refusing_this_processs_cluster_credentials_is_a_peer_it_cannot_use_on_every_hop() -> None:
    """A worker on another cluster secret (mid-rotation) answers UNAUTHENTICATED: to its caller, a peer that is
    unusable (ClusterAuthError, an UnavailableError: moved from, ejected), never the caller's client's credentials.
    A server that met one passes it on as UNAVAILABLE marked so, naming the peer that refused, so the next hop
    (the router, from a decode worker's refused prefill call) reads the same error and can blame that peer."""
    rotated = await _serve(reflection=False, cluster=ClusterSecret(b"rotated"))
    try:
        e = await _call(rotated.address, "boom", cluster=ClusterSecret(b"current"))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        error = error_from_rpc(e, f"decode worker d0 at {rotated.address}")
        assert isinstance(error, ClusterAuthError) and not isinstance(error, UnauthenticatedError)
        assert rotated.address in str(error) and "UNAUTHENTICATED" in str(error)
    finally:
        await rotated.stop(None)
    decode = await _serve(reflection=False)
    try:
        e = await _call(decode.address, "prefill refused")
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        error = error_from_rpc(e, "decode worker d0")
        assert isinstance(error, ClusterAuthError) and PREFILL in str(error)
        gone = error_from_rpc(await _call(decode.address, "prefill gone"), "decode worker d0")
        assert isinstance(gone, UnavailableError) and not isinstance(gone, ClusterAuthError)
    finally:
        await decode.stop(None)


@pytest.mark.parametrize(
    ("prompt", "marked"),
    [
        # A prefill worker refusing a decode worker of other weights: the router reads a KVMismatchError (moved
        # from, no worker ejected), not a fault.
        ("prefill of other weights", KVMismatchError),
        # A prefill worker ending a hand-off the router abandoned: the decode worker that waited on it (a stopped
        # one, resumed) counts no lost peer.
        ("prefill abandoned", AbandonedError),
    ],
)
async def test_a_marked_unavailable_stays_marked_on_every_hop(prompt: str, marked: type[UnavailableError]) -> None:
    """UNAVAILABLE marked by its trailer, which the decode worker passes on marked; a plain one is not read so."""
    decode = await _serve(reflection=False)
    try:
        e = await _call(decode.address, prompt)
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        error = error_from_rpc(e, "decode worker d0")
        assert isinstance(error, marked) and PREFILL in str(error)
        gone = error_from_rpc(await _call(decode.address, "prefill gone"), "decode worker d0")
        assert not isinstance(gone, marked)
    finally:
        await decode.stop(None)


async def test_a_non_peers_message_is_refused_without_being_parsed(monkeypatch) -> None:
    parsed, from_string = [], pb.GenerateRequest.FromString

    def parse(data: bytes) -> pb.GenerateRequest:
        parsed.append(data)
        return from_string(data)

    monkeypatch.setattr(pb.GenerateRequest, "FromString", parse)  # what the servicer's registration reads
    server = await _serve(reflection=False, cluster=ClusterSecret(b"current"))
    try:
        refused = await _call(server.address, "boom", ClusterSecret(b"rotated"))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and parsed == []
        peers = await _call(server.address, "bad", ClusterSecret(b"current"))
        assert peers.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert parsed == [pb.GenerateRequest(prompt="bad").SerializeToString()]
    finally:
        await server.stop(None)


async def test_a_traced_streams_answer_to_its_caller_is_its_status_with_no_stack_trace_on_its_span() -> None:
    """A refusal is the caller's answer, not this service's failure: the tracing interceptor records no exception
    for it (two stack traces each made a refused request's span six times a served one's, while shedding). A bug
    keeps its exception on the span."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.telemetry import Telemetry

    exporter = InMemorySpanExporter()
    telemetry = Telemetry("errors", SimpleSpanProcessor(exporter))
    server = Server("127.0.0.1", 0, interceptors=telemetry.server_interceptors())
    server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(Raising(), s), ["pdserve.v1.Generation"])
    await server.start()
    try:
        shed = await _call(server.address, "full")
        assert shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("grpc-retry-pushback-ms", "250") in tuple(shed.trailing_metadata() or ())
        assert shed.details() == "every decode worker's batch is full"
        assert (await _call(server.address, "boom")).code() == grpc.StatusCode.INTERNAL
        assert (await _call(server.address, "prefill gone")).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
        telemetry.shutdown()
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.attributes["rpc.grpc.status_code"])
    refused, bug, gone = spans
    assert refused.attributes["rpc.grpc.status_code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert [e.name for e in refused.events] == []
    assert bug.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert "exception" in [e.name for e in bug.events]
    # A failure's span names its error's type (OpenTelemetry's `error.type`), as the HTTP API's does; an answer none.
    assert [s.attributes.get("error.type") for s in spans] == [None, "RuntimeError", "UnavailableError"]
