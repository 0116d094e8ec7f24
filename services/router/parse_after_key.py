"""A public call's message is parsed only once its caller's key is known and one of the key's requests_per_second
taken: its handler gets the message unparsed (`Unparsed`) and parses it after those checks (`generation.generate`),
as the HTTP API reads no body before them. Parsing a 16 MiB message of token ids holds the router's event loop
~40 ms (measured on 2 cores), which an unknown caller, or a known one past its rate, could otherwise have for each
of its calls."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.rpc.errors import tolerant


@dataclass(frozen=True)
class Unparsed:
    """A request message as it came, and how it parses (a message that does not becomes what `check_parsed`
    refuses)."""

    data: bytes
    parse: Callable[[bytes], Any]

    def parsed(self) -> Any:
        return self.parse(self.data)


def parsed(request: Any) -> Any:
    """The request message, parsed now if it came unparsed."""
    return request.parsed() if isinstance(request, Unparsed) else request


class ParseAfterKeyCheck(grpc.aio.ServerInterceptor):
    """For `methods` (full names; unary-request handlers that call `parsed` after the caller's checks), the request
    is handed to the handler `Unparsed`."""

    def __init__(self, methods: Collection[str]) -> None:
        self._methods = frozenset(methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in self._methods:
            return handler
        parse = tolerant(handler.request_deserializer) or _as_is
        kinds: dict[str, Any] = {"request_deserializer": lambda data: Unparsed(data, parse)}
        kinds["response_serializer"] = handler.response_serializer
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(handler.unary_stream, **kinds)
        return grpc.unary_unary_rpc_method_handler(handler.unary_unary, **kinds)


def _as_is(data: bytes) -> bytes:
    return data
