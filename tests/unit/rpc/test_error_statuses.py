"""The error interceptor on a real grpc.aio server: a bug's text never reaches the caller, only an id that the
server's log holds beside it; the auth errors get their own codes; reflection is a switch."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.errors import PermissionDeniedError, UnauthenticatedError
from pdserve.rpc.server import Server, channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

SECRET = "/home/alice/.ssh/id_rsa other-tenant-prompt"


class Raising(generate_pb2_grpc.GenerationServicer):
    async def Generate(self, request: pb.GenerateRequest, context: object) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        if request.prompt == "auth":
            raise UnauthenticatedError("no API key")
        if request.prompt == "priority":
            raise PermissionDeniedError("priority", "above this key's cap")
        raise RuntimeError(SECRET)
        yield pb.GenerateResponse()


async def _serve(reflection: bool) -> Server:
    server = Server("127.0.0.1", 0, reflection=reflection)
    server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(Raising(), s), ["pdserve.v1.Generation"])
    await server.start()
    return server


async def _call(address: str, prompt: str) -> grpc.aio.AioRpcError:
    async with channel(address) as ch:
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
            else:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    _ = [r async for r in stub.ServerReflectionInfo(iter([ask]))]
                assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
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
