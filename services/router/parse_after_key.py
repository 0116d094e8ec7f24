"""A public call from a caller without a known API key is never parsed: its handler gets an empty request, and
refuses the caller first (`generation.check_caller`), as the HTTP API reads no body before that check. Parsing a
16 MiB message of token ids holds the router's event loop ~40 ms (measured on 2 cores), which an unknown caller
could otherwise have for each of its calls."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc

from pdserve.errors import UnauthenticatedError
from services.router.lifecycle import RequestLifecycle
from services.router.servicer import caller_headers


class ParseAfterKeyCheck(grpc.aio.ServerInterceptor):
    """For `methods` (full names; unary-request handlers), the request of a caller the lifecycle does not know is
    read as its message type's empty instance."""

    def __init__(self, lifecycle: RequestLifecycle, methods: Collection[str], empty: Callable[[], Any]) -> None:
        self._lifecycle, self._methods, self._empty = lifecycle, frozenset(methods), empty

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in self._methods or self._known(details):
            return handler
        kinds: dict[str, Any] = {"request_deserializer": self._unread}
        kinds["response_serializer"] = handler.response_serializer
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(handler.unary_stream, **kinds)
        return grpc.unary_unary_rpc_method_handler(handler.unary_unary, **kinds)

    def _known(self, details: grpc.HandlerCallDetails) -> bool:
        try:
            self._lifecycle.authenticate(caller_headers(details.invocation_metadata))  # as the handler reads them
        except UnauthenticatedError:
            return False
        return True

    def _unread(self, data: bytes) -> Any:
        return self._empty()
