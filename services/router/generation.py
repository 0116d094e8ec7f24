"""The one request path every public front end runs (gRPC `Generate`, the OpenAI-compatible HTTP API): the
caller's check, then the lifecycle's accounting, admission, placement and relayed stream. A front end only
converts its wire format to a GenerateRequest and the stream back."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

from pdserve.errors import InvalidRequestError
from pdserve.rpc.errors import check_parsed
from pdserve.security.api_keys import Metadata, Tenant
from pdserve.security.quotas import Choices
from pdserve.v1 import generate_pb2 as pb
from services.router.lifecycle import RequestLifecycle
from services.router.parse_after_key import Unparsed, parsed
from services.router.ticket import Ticket


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this router does not serve (the HTTP API's `model`): invalid input, counted
    so, which HTTP answers with OpenAI's 404 `model_not_found`."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


def check_model(lifecycle: RequestLifecycle, model: str) -> None:
    """ModelNotFoundError unless `model` is the one this router serves."""
    if model != lifecycle.served_model:
        raise ModelNotFoundError(
            f"model {model[:128]!r} is not served here; this router serves {lifecycle.served_model!r}"
        )


def check_caller(lifecycle: RequestLifecycle, headers: Metadata) -> Tenant:
    """The one place a caller's headers (gRPC metadata, HTTP headers: `authorization`) are checked: the
    caller's tenant, or UnauthenticatedError (an open cluster serves everyone as one tenant)."""
    return lifecycle.authenticate(headers)


async def generate(
    lifecycle: RequestLifecycle,
    request: pb.GenerateRequest | Unparsed,
    who: Metadata | Tenant,
    time_remaining: Callable[[], float | None],
    on_admitted: Callable[[Ticket], Awaitable[None]],
    model: str | None = None,
    choices: Choices | None = None,
    default_max_tokens: int | None = None,
    arrived_at: float | None = None,
    streamed: bool = True,
    request_taken: bool = False,
) -> AsyncGenerator[pb.GenerateResponse, None]:
    """The request's stream. Everything refused before the first message raises here (InvalidRequestError,
    OverloadedError, UnavailableError, ModelNotFoundError for a `model` not served, and the caller's check
    first of all: UnauthenticatedError, PermissionDeniedError). `who`: the caller's headers, its key checked here,
    or the tenant its front end already checked (the HTTP API, before reading the body: every choice of the request
    is that tenant's, as long as a key reload keeps its key: KeyRevokedError, before or mid-stream, once one does not,
    key_revocation.py). `on_admitted` runs once it is placed, before
    anything is relayed. `choices`: the request is one of these (the HTTP API's `n`), for its key's quotas.
    `default_max_tokens`: the front end's default for a request without max_tokens (None: the router's).
    `arrived_at` (time.perf_counter()): when its caller's request came, if earlier than this call (a later
    choice, held back until the one before it got its first token): its latencies count from there. `streamed`:
    each message reaches the caller as it comes; False (an HTTP answer sent whole) delivers nothing before the end,
    so a failure gives the key's tokens back as a refusal does. The key's request (requests_per_second) is taken
    before `request` is parsed (parse_after_key), and never again: `request_taken` says its front end took it
    before reading the body (the HTTP API; its later choices each take their own here)."""
    start = time.perf_counter()
    arrived = start if arrived_at is None else arrived_at
    with lifecycle.accounting(arrived, choices) as caller:
        caller.time_remaining = time_remaining  # a request its deadline ended counts as deadline_exceeded
        caller.tenant = who if isinstance(who, Tenant) else check_caller(lifecycle, who)
        # Held from here to its end: a key revoked since its check is refused, one revoked later ends the stream.
        with lifecycle.relay.keyed.held(caller.tenant, lifecycle.keys) as keyed:
            if not request_taken:
                if choices is None:  # a request of its own (a later choice of an admitted one is let in)
                    lifecycle.refuse_new_when_draining()
                await lifecycle.quotas.charge_request(caller.tenant)
            message = parsed(request)  # only now: a caller without a key, or over its rate, costs no parse
            if model is not None:
                check_model(lifecycle, model)
            check_parsed(message)
            ids = lifecycle.identify(message)
            async with lifecycle.quotas.session(caller.tenant, choices) as quota:
                ticket = await lifecycle.admit(message, ids, start, quota, default_max_tokens, time_remaining)
                caller.prompt_tokens = len(ticket.request.prompt_token_ids)
                with ticket:
                    await on_admitted(ticket)
                    # Closed here when the caller stops reading, not later by the garbage collector in another task:
                    # the decode call is cancelled and the spans end in this request's context.
                    async with aclosing(lifecycle.stream(ticket, time_remaining, arrived, keyed)) as stream:
                        async for msg in stream:
                            if streamed:
                                quota.delivered()
                            caller.relayed(msg)
                            yield msg
