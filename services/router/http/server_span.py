"""The OpenAI HTTP API's server span, with OpenTelemetry's HTTP semantic-convention attributes (as the gRPC
instrumentation's server span has the RPC ones), so a tracing backend's HTTP views group, filter and time it.

It starts when the request's head arrived: the body's upload, the key's check and its rate's are in it, as they are
in a gRPC call's span. A span that failed carries `error.type` (telemetry.mark_failed), as a gRPC one does.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

from opentelemetry import propagate, trace
from starlette.requests import Request

from pdserve.telemetry import mark_ended_by

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"


def route_of(chat: bool) -> str:
    return CHAT_ROUTE if chat else COMPLETIONS_ROUTE


def server_span(
    tracer: trace.Tracer, request: Request, route: str, arrived: float, user: str = "", on_exception: bool = True
) -> AbstractContextManager[trace.Span]:
    """The request's server span, a child of the caller's trace when its `traceparent` header names one, started at
    `arrived` (time.perf_counter() as its head came). `user`: the body's, as OpenTelemetry's `enduser.id` ("": none,
    or a body refused before it parsed). `on_exception` False: an exception leaves the span as it is (a stream marks
    its own)."""
    url, client = request.url, request.client
    attributes = {
        "http.request.method": request.method,
        "http.route": route,
        "url.path": url.path,
        "url.scheme": url.scheme,
        "server.address": url.hostname,  # from the Host header, as the caller addressed the router
        "server.port": url.port,
        "client.address": client.host if client else None,
        "client.port": client.port if client else None,
        "user_agent.original": request.headers.get("user-agent"),
        "enduser.id": user or None,
    }
    start_ns = time.time_ns() - round((time.perf_counter() - arrived) * 1e9)
    return tracer.start_as_current_span(
        f"{request.method} {route}",
        propagate.extract(request.headers),
        kind=trace.SpanKind.SERVER,
        attributes={k: v for k, v in attributes.items() if v is not None},
        start_time=start_ns,
        record_exception=on_exception,
        set_status_on_exception=on_exception,
    )


def span_status(span: trace.Span, status: int, error: BaseException | None = None) -> None:
    """The response's status on the request's span; an error there only for a 5xx (OpenTelemetry's convention for
    server spans: a 4xx is the client's)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        mark_ended_by(span, error)
