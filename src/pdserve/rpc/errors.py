"""The one mapping between typed exceptions and gRPC status codes, both directions.

Servers raise typed errors and one interceptor turns them into statuses; a caller of another pdserve
server turns the status it got back into the same typed error (`error_from_rpc`), so a code keeps its
meaning across every hop.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from contextlib import aclosing
from typing import Any

import grpc
from opentelemetry import trace

from pdserve.errors import (
    AbandonedError,
    ClusterAuthError,
    InternalError,
    InvalidRequestError,
    KVMismatchError,
    OverloadedError,
    PermissionDeniedError,
    RouterStoppedError,
    UnauthenticatedError,
    UnavailableError,
)

log = logging.getLogger(__name__)
UnaryHandler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamHandler = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]]
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
# Trailer of an UNAVAILABLE that is a ClusterAuthError further in (a decode worker's prefill call refused), so the
# router handles it as the one it got itself.
CLUSTER_AUTH_REFUSED_KEY = "x-pdserve-cluster-auth-refused"
# Trailer of an UNAVAILABLE that is a KVMismatchError further in (a decode worker's prefill call refused for another
# model or block size), so the router moves the request without ejecting a healthy worker.
KV_MISMATCH_KEY = "x-pdserve-kv-mismatch"
ABANDONED_KEY = "x-pdserve-abandoned"
# Trailer of an INTERNAL that a pdserve handler's bug answered, rather than gRPC's own (a broken connection's
# RST_STREAM is INTERNAL too, and is a lost peer).
HANDLER_BUG_KEY = "x-pdserve-handler-bug"
# Trailer of an INVALID_ARGUMENT whose text quotes the request: its text as a log line or a span may keep it
# (InvalidRequestError.recorded), so the next hop records no more of the request than this one did.
RECORDED_KEY = "x-pdserve-recorded-bin"
# The codes OpenTelemetry's conventions mark a gRPC server span ERROR for (rpc/server_spans.py): the span says which
# error it was.
SERVER_FAILURES = frozenset(
    (
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    )
)


# What an OSError's errno says its host ran out of (an EAGAIN is left out: a non-blocking socket's, no exhaustion).
_EXHAUSTED_ERRNOS = {errno.EMFILE: "file descriptors", errno.ENFILE: "file descriptors", errno.ENOMEM: "memory"}


def _exhausted_resource(exc: BaseException) -> str | None:
    """What this process's host ran out of, where `exc` says so: threads (CPython's error where one does not start),
    memory, file descriptors. Another process, on another host, may serve: UNAVAILABLE, which the router retries on
    another worker, ejecting this one a while. INTERNAL, a bug's, reached the caller as it was, never retried."""
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError):
        return _EXHAUSTED_ERRNOS.get(exc.errno or 0)
    if isinstance(exc, RuntimeError) and str(exc).startswith("can't start new thread"):
        return "threads"
    return None


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, UnavailableError | RouterStoppedError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, InternalError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if (resource := _exhausted_resource(exc)) is not None:  # its text may name a file: the log has it, not the caller
        log.error("out of %s on this host: %r", resource, exc, exc_info=exc)
        return grpc.StatusCode.UNAVAILABLE, f"out of {resource} on its host ({type(exc).__name__})"
    return None


def error_from_rpc(e: grpc.aio.AioRpcError, peer: str) -> Exception:
    """A peer's status as the typed error that maps back to the same code; its retry hint is kept. Every peer is
    a cluster peer, so its UNAUTHENTICATED refused this process, not the caller: a ClusterAuthError. Any code not
    named here (gRPC's own INTERNAL of a broken connection, UNKNOWN) is a lost peer: UNAVAILABLE."""
    detail = f"{peer}: {e.details()}"
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        recorded = _value(e.trailing_metadata(), RECORDED_KEY)  # set: the peer's text quotes the request
        return InvalidRequestError("request", detail, None if recorded is None else f"{peer}: {recorded.decode()}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(detail, retry_after_ms(e.trailing_metadata()) or 1000)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(detail)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ClusterAuthError(f"{detail} (UNAUTHENTICATED: it refused this process's cluster credentials)")
    if code == grpc.StatusCode.UNAVAILABLE and _has(e.trailing_metadata(), CLUSTER_AUTH_REFUSED_KEY):
        return ClusterAuthError(f"{detail} (UNAVAILABLE)")
    if code == grpc.StatusCode.UNAVAILABLE and _has(e.trailing_metadata(), KV_MISMATCH_KEY):
        return KVMismatchError(f"{detail} (UNAVAILABLE)")
    if code == grpc.StatusCode.UNAVAILABLE and _has(e.trailing_metadata(), ABANDONED_KEY):
        return AbandonedError(f"{detail} (UNAVAILABLE)")
    if code == grpc.StatusCode.INTERNAL and _has(e.trailing_metadata(), HANDLER_BUG_KEY):
        return InternalError(detail)
    return UnavailableError(f"{detail} ({code.name})")


def _has(metadata: Any, key: str) -> bool:
    return any(k == key for k, _ in metadata or ())


def _value(metadata: Any, key: str) -> Any:
    return next((v for k, v in metadata or () if k == key), None)


def retry_after_ms(metadata: Any) -> int | None:
    """The retry hint a RESOURCE_EXHAUSTED status carries in its trailers, if any."""
    for key, value in metadata or ():
        if key == RETRY_PUSHBACK_KEY:
            return int(value)
    return None


def internal_error_message(exc: BaseException) -> str:
    """A bug's answer to the caller: its text may hold paths, addresses or another request's data, so only the log
    has it, under an id the message names."""
    error_id = uuid.uuid4().hex[:16]
    log.exception("unhandled error in handler (error id %s)", error_id, exc_info=exc, extra={"error_id": error_id})
    return f"internal error (error id {error_id}, in the server's log)"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, stream: bool = False) -> None:
    """Ends the call with the status `exc` maps to. A stream's answer to its caller (all but INTERNAL) ends with the
    status set, not an exception raised: the tracing interceptor around it then records no exception (two stack
    traces per refused request made its span six times a served one's, at the worst moment: while shedding)."""
    mapped = _status_for(exc)
    if mapped is None:
        mapped = (grpc.StatusCode.INTERNAL, internal_error_message(exc))
    span = trace.get_current_span()
    if mapped[0] in SERVER_FAILURES:  # `error.type`, as the HTTP API's span of a failure has (telemetry.mark_failed)
        span.set_attribute("error.type", type(exc).__qualname__)
    if mapped[0] == grpc.StatusCode.INTERNAL:
        span.record_exception(exc)  # a bug's stack trace, for the trace's reader (its caller gets only an id)
        _add_trailing(context, HANDLER_BUG_KEY, "1")
    if isinstance(exc, OverloadedError):
        _add_trailing(context, RETRY_PUSHBACK_KEY, str(exc.retry_after_ms))
    if isinstance(exc, ClusterAuthError):
        _add_trailing(context, CLUSTER_AUTH_REFUSED_KEY, "1")
    if isinstance(exc, KVMismatchError):
        _add_trailing(context, KV_MISMATCH_KEY, "1")
    if isinstance(exc, AbandonedError):
        _add_trailing(context, ABANDONED_KEY, "1")
    if isinstance(exc, InvalidRequestError) and exc.recorded != str(exc):
        _add_trailing(context, RECORDED_KEY, exc.recorded.encode())
    if stream and mapped[0] != grpc.StatusCode.INTERNAL:
        context.set_code(mapped[0])
        context.set_details(mapped[1])
        return
    await context.abort(*mapped)


def _add_trailing(context: grpc.aio.ServicerContext, key: str, value: str | bytes) -> None:
    """Beside what the handler already set (the public Generate's request id): setting replaces it whole."""
    context.set_trailing_metadata((*(context.trailing_metadata() or ()), (key, value)))


class _Malformed:
    """What a request that does not parse (bad wire format, invalid UTF-8 in a string) becomes, so the handler
    answers INVALID_ARGUMENT instead of gRPC's UNKNOWN with the parser's exception text."""


_MALFORMED = _Malformed()


def tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserialize`, answering a message that does not parse with what `check_parsed` refuses, not an error."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:
            return _MALFORMED

    return parse


def check_parsed(request: Any) -> None:
    """InvalidRequestError for a request message that did not parse (see ErrorMappingInterceptor)."""
    if request is _MALFORMED:
        raise InvalidRequestError("request", "the message does not parse (corrupt wire format or invalid UTF-8)")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps the typed errors handlers raise to status codes, and answers a request message that does not parse
    with INVALID_ARGUMENT instead of gRPC's UNKNOWN (or INTERNAL). The handlers of `checked_by_handler` (full
    method names) get such a message as it is and call `check_parsed` themselves: where they count their
    requests, a malformed one is counted too."""

    def __init__(self, checked_by_handler: Collection[str] = ()) -> None:
        self.checked_by_handler = frozenset(checked_by_handler)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        check = handler_call_details.method not in self.checked_by_handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, check),
                request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            # A streaming handler that writes with `context.write` (Health.Watch) is a coroutine, not a generator.
            fn = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(fn, check) if inspect.isasyncgenfunction(fn) else _wrap_unary(fn, check),
                request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(fn: UnaryHandler, check: bool) -> UnaryHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if check:
                check_parsed(request)
            return await fn(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            await _abort(context, e)

    return unary


def _wrap_stream(fn: StreamHandler, check: bool) -> StreamHandler:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
        try:
            if check:
                check_parsed(request)
            async with aclosing(fn(request, context)) as items:  # closed here, in the call's span and task
                async for item in items:
                    yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            await _abort(context, e, stream=True)

    return stream
