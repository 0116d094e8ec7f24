"""The OpenAI-compatible HTTP API as an ASGI app: JSON in, the shared request path (generation.py), JSON or
Server-Sent Events out. Nothing here decides anything about a request; it converts, like the gRPC servicer."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator
from contextlib import AbstractContextManager, aclosing, suppress

from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Send

from pdserve.rpc.metadata import REQUEST_ID_KEY
from pdserve.security.api_keys import Tenant
from pdserve.security.quotas import Choices
from pdserve.telemetry import CALLER_FAULTS, mark_ended_by, mark_failed, request_id_var
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import check_caller, check_model, generate
from services.router.http.choices import each_choice, request_choices
from services.router.http.connection_close import CloseWhileDraining
from services.router.http.cors import with_cors
from services.router.http.errors import (
    BodyTimeoutError,
    BodyTooLargeError,
    UnsupportedBodyError,
    error_body,
    error_response,
)
from services.router.http.json_values import parse_json
from services.router.http.keepalive import KeptAliveBody
from services.router.http.openai_request import OpenAIRequest, parse_request
from services.router.http.openai_response import DONE_EVENT, Answer, sse_events
from services.router.http.request_id_header import RequestIdHeader, echoed_request_id, generated_request_id
from services.router.http.server_span import CHAT_ROUTE, COMPLETIONS_ROUTE, route_of, server_span, span_status
from services.router.lifecycle import RequestLifecycle
from services.router.peer_check import PeerCheck
from services.router.request_size import http_body_limit
from services.router.ticket import Ticket

PREDICTED_TTFT_HEADER = "x-pdserve-predicted-ttft-ms"
BODY_TIMEOUT_S = 30.0  # from the head's end: the largest body the router may take (16 MiB) at 0.6 MB/s


def openai_app(lifecycle: RequestLifecycle, peers: PeerCheck | None = None) -> ASGIApp:
    """`peers`: the router's check that the workers accept its cluster credentials, which /health reports. CORS
    wraps Starlette's whole app, its error middleware included (cors.py); the drain's `Connection: close` wraps
    that, so a preflight during the drain says it too; the request id (request_id_header.py) wraps them all."""
    api = OpenAIAPI(lifecycle, peers)
    app = Starlette(
        routes=[
            Route(COMPLETIONS_ROUTE, api.completions, methods=["POST"]),
            Route(CHAT_ROUTE, api.chat_completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/", api.models, methods=["GET"]),
            Route("/v1/models/{model:path}", api.model, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error},
    )
    closing = CloseWhileDraining(with_cors(app, lifecycle.config), draining=lambda: lifecycle.draining)
    return RequestIdHeader(closing, lifecycle.config.request_limits.max_request_id_chars)


class OpenAIAPI:
    def __init__(self, lifecycle: RequestLifecycle, peers: PeerCheck | None) -> None:
        self.lifecycle = lifecycle
        self.peers = peers
        self.created = int(time.time())
        self.body_limit = http_body_limit(lifecycle.config, lifecycle.model)

    async def health(self, request: Request) -> Response:
        """200 while the router takes requests, 503 once it drains or while the workers refuse its cluster
        credentials (a load balancer's readiness probe)."""
        if self.lifecycle.draining:
            return JSONResponse({"status": "draining"}, 503)
        if self.peers is not None and self.peers.refused:
            return JSONResponse({"status": "the workers refuse this router's cluster credentials"}, 503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            check_caller(self.lifecycle, request.headers)
        except Exception as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [self._served()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}` (the SDK's models.retrieve): the served model, else 404 model_not_found."""
        try:
            check_caller(self.lifecycle, request.headers)
            check_model(self.lifecycle, request.path_params["model"])
        except Exception as e:
            return error_response(e)
        return JSONResponse(self._served())

    def _served(self) -> dict[str, object]:
        """OpenAI's model object, with vLLM's `max_model_len`, the longest prompt + max_tokens served (a client sizes
        max_tokens by it): the context, or less where the largest worker's KV holds less (its last token takes no
        KV slot), as vLLM's never exceeds what its KV holds."""
        longest = self.lifecycle.model.max_position_embeddings
        if (kv_room := self.lifecycle.placement.kv_capacity_tokens()) is not None:
            longest = min(longest, kv_room + 1)
        model = {"id": self.lifecycle.served_model, "object": "model", "created": self.created, "owned_by": "pdserve"}
        return model | {"max_model_len": longest}

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        start, tenant = time.perf_counter(), None  # the head's arrival: the request's span starts there
        limits, given = self.lifecycle.config.request_limits, request.headers.get("x-request-id", "")
        request_id = given or generated_request_id(limits.max_request_id_chars)
        try:
            tenant = check_caller(self.lifecycle, request.headers)  # a caller without a valid key learns nothing more
            # Its requests_per_second before its body is read: refused, the body is left unread as a 401's is (the
            # server reads its bytes off the connection and drops them), never parsed. Its first choice uses it. A
            # draining router refuses it before that charge, for its retry on another replica.
            self.lifecycle.refuse_new_when_draining()
            await self.lifecycle.quotas.charge_request(tenant)
            body = await _read_body(request, self.body_limit)
            req = parse_request(
                parse_json(body), chat, limits=limits, model_config=self.lifecycle.model, request_id=request_id
            )
            req.check_request_id(limits.max_request_id_chars)
            choices = await request_choices(self.lifecycle, req, tenant)
        except ClientDisconnect:  # the caller left while it sent the body: nobody to answer
            self.lifecycle.refused(asyncio.CancelledError("the client disconnected during its body"), start, tenant)
            return Response(status_code=499)
        except Exception as e:  # a bug converting a body is a 500 in OpenAI's shape too, its text only in the log
            response = error_response(e)
            # The refusal's id, as a served request's (OpenAI's SDK reads it for `request_id`), in its log line too;
            # an id over the limit or of other than printable ASCII (the refusal's reason) is not echoed.
            request_id = echoed_request_id(request_id, limits.max_request_id_chars)
            request_id_var.set(request_id)
            response.headers[REQUEST_ID_KEY] = request_id
            with self._span(request, chat, start) as span:  # in its caller's trace, as a gRPC call's refusal is
                # Its log line in the span, which that line leads to; its `refused` marks the span (accounting).
                self.lifecycle.refused(e, start, tenant)
                span_status(span, response.status_code, e)
            return response
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{req.message.request_id}"
        answer = Answer(req, answer_id, self.lifecycle.tokenizer)
        if req.stream:
            events = self._events(req, choices, answer, request, tenant, start)
            streamed = SSEResponse(events, req.max_tokens_param, self.lifecycle.config.sse_keepalive_s)
            streamed.headers[REQUEST_ID_KEY] = req.message.request_id
            return streamed
        headers: dict[str, str] = {REQUEST_ID_KEY: req.message.request_id}
        with self._span(request, chat, start, req.user) as span:
            whole = asyncio.ensure_future(self._whole(req, choices, answer, tenant, headers, start))
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not whole.done():  # the caller left (or the server stops): stop generating for nobody
                    whole.cancel()
                    with suppress(asyncio.CancelledError):
                        await whole  # its ticket and KV are released before the span ends
            if whole.cancelled():  # the caller's leaving, no failure of the router's (as a stream's is)
                span.set_attribute("cancelled", True)
                span_status(span, 499)
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            try:
                whole.result()
            except Exception as e:
                response = error_response(e, req.max_tokens_param)
                response.headers[REQUEST_ID_KEY] = req.message.request_id
                span_status(span, response.status_code, e)
                return response
            span_status(span, 200)
        return Response(await answer.whole_json(), headers=headers, media_type="application/json")

    async def _whole(
        self,
        req: OpenAIRequest,
        choices: Choices | None,
        answer: Answer,
        tenant: Tenant,
        headers: dict[str, str],
        arrived: float,
    ) -> None:
        async for index, msg in self._choices(req, choices, tenant, headers, arrived):
            await answer.add_off_the_loop(index, msg)

    async def _events(
        self,
        req: OpenAIRequest,
        choices: Choices | None,
        answer: Answer,
        request: Request,
        tenant: Tenant,
        arrived: float,
    ) -> AsyncGenerator[bytes, None]:
        """Within one task (the response's), so the span and the request's context live and end there. An error
        before the first event is the response's status (SSEResponse): an error on the span only when a 5xx."""
        with self._span(request, req.chat, arrived, req.user, on_exception=False) as span:
            started = False
            try:
                async with aclosing(sse_events(answer, self._choices(req, choices, tenant, {}, arrived))) as events:
                    async for event in events:
                        if not started:
                            span_status(span, 200)
                            started = True
                        yield event
            except (asyncio.CancelledError, GeneratorExit):  # the caller hung up: its leaving, no failure
                span.set_attribute("cancelled", True)
                raise
            except Exception as e:
                if not started:
                    span_status(span, error_body(e, req.max_tokens_param)[0], e)
                elif isinstance(e, CALLER_FAULTS):  # a revoked key, an output its constraint could not hold
                    mark_ended_by(span, e)
                else:  # it broke an open stream: the server's failure, a shed included
                    mark_failed(span, e)
                raise

    def _choices(
        self, req: OpenAIRequest, choices: Choices | None, tenant: Tenant, headers: dict[str, str], arrived: float
    ) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
        """Every choice's messages, tagged with its index (choices.py), each choice run as this API runs one. The
        first to start uses the request the key was charged before its body was read; each later one is charged its
        own, as a request of its own."""
        started = itertools.count()

        def one(message: pb.GenerateRequest, choices: Choices | None) -> AsyncGenerator[pb.GenerateResponse, None]:
            return self._generate(message, req, tenant, headers, arrived, choices, next(started) == 0)

        return each_choice(self.lifecycle, req, choices, one, tenant, arrived)

    def _generate(
        self,
        message: pb.GenerateRequest,
        req: OpenAIRequest,
        tenant: Tenant,
        headers: dict[str, str],
        arrived_at: float,
        choices: Choices | None,
        request_taken: bool,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        async def on_admitted(ticket: Ticket) -> None:
            headers[PREDICTED_TTFT_HEADER] = str(round(ticket.placement.predicted_ttft_s * 1e3))

        return generate(
            self.lifecycle,
            message,
            tenant,
            lambda: None,
            on_admitted,
            req.model,
            choices,
            req.default_max_tokens,
            arrived_at,
            streamed=req.stream,
            request_taken=request_taken,
        )

    def _span(
        self, request: Request, chat: bool, arrived: float, user: str = "", on_exception: bool = True
    ) -> AbstractContextManager[trace.Span]:
        """The request's server span (server_span.py), from its head's arrival; the body's `user` on it only where the
        router's `trace_enduser_id` says so."""
        user = user if self.lifecycle.config.trace_enduser_id else ""
        return server_span(self.lifecycle.telemetry.tracer, request, route_of(chat), arrived, user, on_exception)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body; UnsupportedBodyError for one sent compressed or not as JSON (_check_form), before any of it is read.
    BodyTooLargeError as soon as it is known to be past `limit`: from its Content-Length before any of it is read,
    else once what came would pass it. No more than `limit` bytes are ever held. BodyTimeoutError when it is not all
    in within BODY_TIMEOUT_S: a client sending it a byte at a time would hold its connection and a descriptor for
    ever, as a slow head would (connection_deadlines)."""
    _check_form(request)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLargeError(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                if len(body) + len(chunk) > limit:
                    raise BodyTooLargeError(limit)
                body += chunk
    except TimeoutError:
        raise BodyTimeoutError(BODY_TIMEOUT_S) from None
    return bytes(body)


def _check_form(request: Request) -> None:
    """A body compressed (gzip and the like would be read as bytes that are no JSON) or sent as a type other than
    JSON is refused. The types FastAPI (vLLM's server) reads as JSON: none, `application/json` or
    `application/*+json`, any parameters. A form, `text/plain` or a body of no type is what a web page may make a
    visitor's browser send to any address without asking it first (CORS), so a router without API keys would serve
    that page, whatever origins --http-cors-origins allows: no type is taken only from a caller that is no browser
    (no `Origin` header). And `curl -d` without a
    JSON Content-Type is a client's mistake better named than served."""
    encoding = request.headers.get("content-encoding", "").strip().lower() or "identity"
    if encoding != "identity":
        raise UnsupportedBodyError(
            f"is sent with Content-Encoding {encoding[:64]!r}; this API takes bodies uncompressed"
        )
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if not media and "origin" in request.headers:
        raise UnsupportedBodyError(
            "is sent by a browser (an Origin header) with no Content-Type; send application/json"
        )
    if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedBodyError(f"is sent as Content-Type {content_type[:64]!r}; this API takes application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    """A path or method the API does not have, in OpenAI's error shape (the SDK reads its message from it), with
    OpenAI's type for an unknown URL."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, exc.status_code, exc.headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up. The body is read by then, so `http.disconnect` is all that can come;
    a streamed response listens the same way inside Starlette."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """A stream whose status waits for its first event, for up to `keepalive_s`: a request refused before then
    (invalid, shed, nowhere to place it) gets the same JSON error and status as a non-streaming one. An error once
    the stream started can only end it: an `error` event, then `[DONE]` as every stream ends (vLLM's too), so a
    reader waiting for it does not take the stream for cut. A silence of `keepalive_s`, the first event's wait
    included, sends a comment (keepalive.py)."""

    def __init__(self, events: AsyncGenerator[bytes, None], max_tokens_param: str, keepalive_s: float) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.events, self.max_tokens_param, self.keepalive_s = events, max_tokens_param, keepalive_s

    async def stream_response(self, send: Send) -> None:
        # Closed here whatever ends it: a client that hangs up while a write waits (a slow reader) is a cancel in
        # `send`, outside the events, which would otherwise stay suspended with their span, ticket and decode call
        # until a garbage collection in another task.
        async with aclosing(self.events) as events:
            await self._stream(events, send)

    async def _stream(self, events: AsyncGenerator[bytes, None], send: Send) -> None:
        body = KeptAliveBody(send, self.keepalive_s, self.status_code, self.raw_headers)
        try:
            async with body:
                async for event in events:
                    await body.send(event)
        except Exception as e:
            status, error, headers = error_body(e, self.max_tokens_param)
            if body.started:
                event = b"data: " + json.dumps(error).encode() + b"\n\n" + DONE_EVENT
                await send({"type": "http.response.body", "body": event})
                return
            data = json.dumps(error).encode()
            raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            raw += [(k.encode(), v.encode()) for k, v in headers.items()]
            raw += [(k, v) for k, v in self.raw_headers if k == REQUEST_ID_KEY.encode()]  # the request's, refused
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": data})
            return
        if not body.started:  # no event at all: none of the streams the API makes, but a response all the same
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
