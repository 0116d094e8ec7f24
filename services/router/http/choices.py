"""A request's choices, each a request of its own through the shared path: each prompt's `n` (one prompt, or a
completions batch, prompt by prompt). They are judged and charged together (`Choices`), start one after another,
and the first to fail ends them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from pdserve.errors import InvalidRequestError
from pdserve.security.api_keys import Tenant
from pdserve.security.quotas import Choices
from pdserve.telemetry import step_span
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import check_model
from services.router.http.openai_request import OpenAIRequest
from services.router.lifecycle import RequestLifecycle
from services.router.request import build_request, capped_default

# One choice's stream, given its request and the request's choices (None: it is the only one).
Generate = Callable[[pb.GenerateRequest, Choices | None], AsyncGenerator[pb.GenerateResponse, None]]


async def request_choices(lifecycle: RequestLifecycle, req: OpenAIRequest, tenant: Tenant) -> Choices | None:
    """The request's choices for its key's quotas, None for one. A batch's prompts are each built here, tokenized,
    checked and judged against what an idle cluster serves (its largest KV, its SLOs), as their own admission will
    do again: a bad one is a 400 naming its index before any choice runs (not an error once the prompts before it
    streamed), and the first choice charges what all of them need."""
    if len(req.prompts) == 1:
        return Choices(req.n) if req.n > 1 else None
    check_model(lifecycle, req.model)  # a model not served is its 404 first, as for one prompt
    config, tokens = lifecycle.config, 0
    default = capped_default(req.default_max_tokens, config.default_max_tokens)
    kv_room = lifecycle.placement.kv_capacity_tokens()  # as each prompt's own admission will bound its default
    for i, message in enumerate(req.prompts):
        try:
            built = await build_request(
                message, lifecycle.tokenizer, lifecycle.model, default, config.request_limits, tenant.name, kv_room
            )
            placement, slo = await lifecycle.place(built)
            lifecycle.admission.check_feasible(placement, len(built.prompt_token_ids), slo)
        except InvalidRequestError as e:
            which = f"prompt {i}: "
            raise InvalidRequestError(e.field, which + e.message, which + e.recorded_message) from None
        tokens += (len(built.prompt_token_ids) + built.sampling.max_tokens) * req.n
    return Choices(req.choices, prompts=len(req.prompts), tokens=tokens)


async def each_choice(
    lifecycle: RequestLifecycle,
    req: OpenAIRequest,
    choices: Choices | None,
    generate: Generate,
    tenant: Tenant,
    arrived: float,
) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
    """Each choice's messages tagged with its index, as they come. With several, every choice is a request of its
    own, and each starts once the one before it got its first token: it then meets its prompt (a batch's prompts
    often share a prefix too) in that prefill worker's prefix cache (placement prefers the worker holding it, so
    the prompt is computed once), and a prefill queue that admits one such prompt at a time admits every choice in
    turn. The first choice to fail cancels the others (their KV freed) and raises. The first choice charges the
    key's tokens for all (`Choices`); once it is admitted, a drain of the router waits for the rest and lets them
    in. Every choice's latencies count from `arrived`, the request's head: its body's upload and parse, and a later
    choice's wait for the one before it, are in them as in its caller's clock."""
    if choices is None:
        async with aclosing(generate(req.message, None)) as messages:
            async for msg in messages:
                yield 0, msg
        return
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()
    first_token = [asyncio.Event() for _ in range(choices.n)]

    async def run(index: int) -> None:
        # A span of its own under the request's: each choice is placed and streamed apart, and its ids and
        # counts would overwrite the others' on one span. Its failure is marked there (step_span).
        started = False
        try:
            with step_span(lifecycle.telemetry.tracer, "choice", choice__index=index):
                if index:
                    await first_token[index - 1].wait()
                started = True
                async for msg in generate(req.choice_message(index), choices):
                    first_token[index].set()
                    queue.put_nowait((index, msg))
                queue.put_nowait((index, None))
        except asyncio.CancelledError:
            if not started:  # never a request of its own: counted as the others ended, failed or the caller's cancel
                ended = choices.failure if choices.failure is not None else asyncio.CancelledError()
                lifecycle.refused(ended, arrived, tenant)
            raise
        except Exception as e:
            queue.put_nowait((index, e))

    with lifecycle.holding():
        tasks = [asyncio.ensure_future(run(i)) for i in range(choices.n)]
        try:
            running, sent = choices.n, False
            while running:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    # With nothing delivered the tokens go back, as a request of one choice's do: a 429 or
                    # 503 promises a retry may succeed, and it must find them. Streamed choices already sent
                    # keep them; so does the caller's own deadline (a 504).
                    if not (req.stream and sent) and not isinstance(item, TimeoutError):
                        choices.refund()
                    raise item
                if item is None:
                    running -= 1
                else:
                    sent = True
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
