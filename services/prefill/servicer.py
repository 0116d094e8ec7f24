"""PrefillWorker gRPC service: converts, and hands the request to run-and-send; ends a request's hand-off when the
router abandons it (its decode worker, stopped or hung, cannot cancel the call itself).

An Abandon can overtake its Prefill call: a decode worker frozen between sending the call and its arrival here (or
one whose call waits on a congested connection) resumes after the router gave up. The key of an Abandon that found
no call is kept (the last EARLY_ABANDONS_KEPT of them: an attempt's key is never sent twice), and a Prefill call
that comes with it ends at once, before its prompt takes a KV block; else it held them until keepalive ended it."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from functools import partial

import grpc

from pdserve.errors import AbandonedError
from pdserve.protocol.handoff import FirstToken, KVSent, KVTarget
from pdserve.rpc.convert import (
    engine_request_from_pb,
    finish_reason_to_pb,
    logprobs_to_pb,
    off_the_loop_when_constrained,
)
from pdserve.rpc.raced_steps import until_ended
from pdserve.telemetry import request_id_var
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.prefill.run_and_send import PrefillJob, RunAndSend

log = logging.getLogger(__name__)

EARLY_ABANDONS_KEPT = 4096  # ~0.5 MB of keys; an Abandon takes at most milliseconds to overtake its call


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, run_and_send: RunAndSend) -> None:
        self.run_and_send = run_and_send
        self._abandoned: dict[str, asyncio.Future[None]] = {}  # each Prefill call's, by request id, until it ends
        self._abandoned_early: OrderedDict[str, None] = OrderedDict()  # keys abandoned before their call came

    async def Prefill(  # noqa: N802 (gRPC method name)
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[wpb.PrefillEvent, None]:
        request_id_var.set(request.client_request_id or request.request_id)
        if request.request_id in self._abandoned_early:
            del self._abandoned_early[request.request_id]
            raise _abandoned_error()
        # Listed first: an abandon that comes while the request is converted (a grammar compiled) still ends it.
        abandoned = asyncio.get_running_loop().create_future()
        self._abandoned[request.request_id] = abandoned
        try:
            target = request.target
            work = await off_the_loop_when_constrained(partial(engine_request_from_pb, request), request.sampling)
            work = await self.run_and_send.engine.prepare(work)
            if abandoned.done():
                raise _abandoned_error()
            job = PrefillJob(
                work,
                KVTarget(
                    target.decode_worker_id,
                    target.rendezvous,
                    list(target.block_ids),
                    target.tag,
                    request.layout.model_fingerprint,
                    request.layout.block_size,
                ),
                request.transfer_timeout_ms / 1e3,
                request.client_request_id,
            )
            async with contextlib.aclosing(self.run_and_send.run(job)) as run:  # type: ignore[type-var]
                steps = contextvars.copy_context()
                async with contextlib.aclosing(until_ended(run, abandoned, steps, _abandoned_error)) as events:
                    async for event in events:
                        yield _to_pb(event)
        finally:
            if self._abandoned.get(request.request_id) is abandoned:
                del self._abandoned[request.request_id]

    async def Abandon(  # noqa: N802 (gRPC method name)
        self, request: wpb.AbandonRequest, context: grpc.aio.ServicerContext
    ) -> wpb.AbandonReply:
        """Ends the request's Prefill call as its caller's cancel would: the prompt's KV blocks are freed at once,
        unless their send is already under way (it ends by its own deadline)."""
        abandoned = self._abandoned.get(request.request_id)
        if abandoned is None:
            self._abandoned_early[request.request_id] = None  # its call may still come (or ended: kept alike)
            if len(self._abandoned_early) > EARLY_ABANDONS_KEPT:
                self._abandoned_early.popitem(last=False)
            return wpb.AbandonReply(ended=False)
        if abandoned.done():
            return wpb.AbandonReply(ended=False)
        abandoned.set_result(None)
        log.info("hand-off abandoned by the router before its first token", extra={"key": request.request_id})
        return wpb.AbandonReply(ended=True)


def _abandoned_error() -> AbandonedError:
    return AbandonedError("the router ended this attempt before its first token (its caller left, or it gave up on it)")


def _to_pb(event: FirstToken | KVSent) -> wpb.PrefillEvent:
    if isinstance(event, KVSent):
        return wpb.PrefillEvent(transfer_done=wpb.TransferDone())
    first = wpb.FirstToken(
        token_id=event.token_id,
        kv_follows=event.kv_follows,
        cached_prompt_tokens=event.cached_prompt_tokens,
        finish_reason=finish_reason_to_pb(event.finish_reason),
    )
    if event.waited_s is not None:
        first.waited_ms = round(event.waited_s * 1e3)
    if event.logprobs is not None:
        first.logprobs.CopyFrom(logprobs_to_pb(event.logprobs))
    first.prompt_logprobs.extend(logprobs_to_pb(lp) for lp in event.prompt_logprobs)
    return wpb.PrefillEvent(first_token=first)
