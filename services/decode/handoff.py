"""The decode worker's side of a disaggregated request: reserve the prompt's KV blocks, have the prefill worker
fill them, then decode in the running batch and stream.

A failed hand-off frees its blocks on every path: at once when nothing can write into them any more, else (a
receive whose bytes already flow) when that receive ends, at the latest the transfer timeout after they began. A
cancelled caller cancels the Prefill call and a receive still waiting for its transfer, so a stuck prefill worker
holds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.errors import OverloadedError, UnavailableError
from pdserve.metrics import WorkerMetrics
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken, KVTarget
from pdserve.protocol.outputs import RequestOutput
from pdserve.telemetry import Telemetry, mark_ended_by, now_ns
from pdserve.transfer.base import KVReceiver, TransferError, TransferTimeoutError
from pdserve.transfer.failures import failure_reason
from pdserve.transfer.threads import in_transfer_thread
from services.decode.prefill_client import PrefillCall, PrefillClient

log = logging.getLogger(__name__)
TimeRemaining = Callable[[], float | None]  # seconds left of the caller's deadline; None: it set none


@dataclass(frozen=True)
class HandoffRequest:
    request: EngineRequest  # what both engines run: the decode worker's reserves, the prefill worker's prefills
    prefill_address: str  # host:port of the prefill worker the router placed it on
    client_request_id: str = ""  # the caller's own id: echoed in logs and traces, never a key


@dataclass
class Handoff:
    """One decode worker's hand-offs; `transfer_timeout_s` bounds each KV transfer's start, and its bytes once
    they flow (the request's own deadline cancels the hand-off, not the transfer on the wire)."""

    engine: AsyncEngine
    receiver: KVReceiver
    prefill: PrefillClient
    worker_id: str
    telemetry: Telemetry
    transfer_timeout_s: float
    metrics: WorkerMetrics | None = None  # counts the receives that failed
    # Frees waiting for a receive to end; a strong reference each until done (the loop keeps only weak ones).
    _freeing: set[asyncio.Future[None]] = field(default_factory=set, init=False)

    async def stream(
        self,
        handoff: HandoffRequest,
        time_remaining: TimeRemaining,
        on_dispatched: Callable[[], Awaitable[None]],
        on_prefilled: Callable[[FirstToken], None] = lambda first: None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs; the last one counts the prompt tokens the prefill worker's cache served.
        `on_dispatched` runs once the prefill worker has been called (what is slow from then on is its side),
        `on_prefilled` once its first token and KV are in."""
        try:
            blocks = await self.engine.reserve(handoff.request)
        except OverloadedError as e:
            raise OverloadedError(f"decode worker {self.worker_id} cannot take it: {e}", e.retry_after_ms) from e
        first = await self._fill(handoff, blocks, time_remaining, on_dispatched)  # frees `blocks` if it fails
        on_prefilled(first)
        async with contextlib.aclosing(self._decode(handoff, first)) as decoded:  # type: ignore[type-var]
            async for out in decoded:
                yield replace(out, num_cached_tokens=first.cached_prompt_tokens)

    async def _fill(
        self,
        handoff: HandoffRequest,
        blocks: list[int],
        time_remaining: TimeRemaining,
        on_dispatched: Callable[[], Awaitable[None]],
    ) -> FirstToken:
        """Has the prefill worker fill `blocks`; returns its first token once the KV is in place. Fails as soon
        as the transfer or the prefill worker fails, or the caller leaves, and then frees `blocks`."""
        peer, tag = handoff.prefill_address, secrets.randbits(63)  # unguessable: names no other request
        receive: asyncio.Future[int] | None = None
        call: PrefillCall | None = None
        # The wire's deadline on both sides, never the caller's: a deadline passing while bytes flow would break
        # the (prefill, decode) pair and every other request's transfer on it. A caller that leaves is handled
        # here (`_free`: a receive not started is cancelled, a flowing one ends before its blocks are freed).
        timeout_s = self.transfer_timeout_s
        try:
            rendezvous = await self._rendezvous(peer)
            target = KVTarget(self.worker_id, rendezvous, blocks, tag, self.engine.fingerprint, self.engine.block_size)
            call = self.prefill.prefill(peer, handoff, target, timeout_s, time_remaining())
            await on_dispatched()
            first = await call.first_token()  # bounded by the caller's deadline, or its cancel
            if not first.kv_follows:
                await call.sent()
                call = None  # as below
                return first
            receive = asyncio.ensure_future(
                in_transfer_thread(self.receiver.recv, peer, tag, self.engine.kv_caches, blocks, timeout_s)
            )
            receive.add_done_callback(_read_outcome)
            await self._until_received(handoff, call, receive, len(blocks))
            call = None  # it ended OK: no await below, where a cancel would skip the free of a received reservation
            return first
        except BaseException as e:
            self._free(handoff.request.request_id, peer, tag, receive)
            if isinstance(e, TransferTimeoutError):
                raise UnavailableError(f"KV transfer from {peer} timed out after {timeout_s:g}s: {e}") from e
            if isinstance(e, TransferError):
                raise UnavailableError(f"KV transfer from {peer} failed: {e}") from e
            raise
        finally:
            if call is not None:
                await call.cancel()  # no-op once finished; on our caller's cancel it stops the prefill too

    async def _rendezvous(self, peer: str) -> str:
        """The store address the prefill worker sends to. A store this worker cannot open (its ports' span taken)
        is this worker's failure, not the prefill worker's (whose address the message must not name) nor a bug."""
        try:
            return await in_transfer_thread(self.receiver.rendezvous, peer)
        except (OSError, RuntimeError) as e:
            raise UnavailableError(f"decode worker {self.worker_id} cannot open a KV rendezvous: {e}") from e

    async def _until_received(
        self, handoff: HandoffRequest, call: PrefillCall, receive: asyncio.Future[int], num_blocks: int
    ) -> None:
        """Waits for the KV to land and the prefill worker to confirm it; traces the receive, however it ends, and
        counts it when it failed."""
        ids = {"request__id": handoff.request.request_id, "worker__id": self.worker_id, "kv__blocks": num_blocks}
        start_ns = now_ns()
        try:
            nbytes = await _until_transferred(call, receive)
        except BaseException as e:
            self.telemetry.span("kv_transfer.recv", start_ns, now_ns(), e, **ids)
            if self.metrics is not None:
                self.metrics.transfer_failed(failure_reason(e))
            raise
        self.telemetry.span("kv_transfer.recv", start_ns, now_ns(), **ids, kv__bytes=nbytes)

    async def _decode(self, handoff: HandoffRequest, first: FirstToken) -> AsyncGenerator[RequestOutput, None]:
        """Commits the received KV and streams the decode. The stream span starts when the sequence joins the
        batch: that moment (the first step that runs it) is known only once its first decoded token arrives."""
        ids = {"request.id": handoff.request.request_id, "worker.id": self.worker_id}
        committed_ns = now_ns()
        tokens = 0
        stream, ended_by = None, None
        committed = self.engine.commit_and_stream(handoff.request.request_id, first)
        # Closed here, not when the garbage collector reaches it: a stream its caller closed (not cancelled) would
        # otherwise go on decoding, its blocks held, for nobody.
        try:
            async for out in committed:
                if not tokens:  # the first token's output: the prefill worker's prompt logprobs go with it
                    out = replace(out, prompt_logprobs=first.prompt_logprobs)
                tokens += len(out.new_token_ids)
                if stream is None and tokens > 1:
                    ran = self.engine.take_started(handoff.request.request_id)
                    ran_ns = ran.wall_ns if ran else committed_ns
                    self.telemetry.span("decode.queue_wait", committed_ns, ran_ns, **ids)
                    stream = self.telemetry.tracer.start_span("decode.stream", start_time=ran_ns, attributes=ids)
                yield out
        except BaseException as e:
            ended_by = e
            raise
        finally:
            if stream is None:
                stream = self.telemetry.tracer.start_span("decode.stream", start_time=committed_ns, attributes=ids)
            mark_ended_by(stream, ended_by)
            stream.set_attribute("completion_tokens", tokens)
            stream.set_attribute("prompt_tokens", len(handoff.request.prompt))
            stream.end()
            await committed.aclose()  # last: the span is ended even if this raises
            log.debug("decode finished", extra={"completion_tokens": tokens})

    def _free(self, request_id: str, peer: str, tag: int, receive: asyncio.Future[int] | None) -> None:
        """Frees a failed hand-off's blocks once nothing writes into them any more. A receive still waiting for
        its transfer is cancelled (it ends at once); one whose bytes already flow ends by their own deadline; one
        not posted yet is cancelled too, so the prefill worker's transfer for it is refused, not waited on. The
        caller hears of the failure now, and the blocks go when the receive ends."""
        if receive is None or not receive.done():
            self.receiver.cancel(peer, tag)

        async def when_received() -> None:
            if receive is not None:
                await asyncio.wait([receive])
            with contextlib.suppress(EngineDeadError):  # its blocks went with it
                await self.engine.abort(request_id)

        task = asyncio.ensure_future(when_received())
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)


async def _until_transferred(call: PrefillCall, receive: asyncio.Future[int]) -> int:
    """The bytes received, once the KV is in place and the prefill worker confirmed it. Whichever side fails
    first fails the transfer: a stalled prefill worker (stream open, no bytes) meets the receive's timeout, a
    lost one its stream's error, even while the receive still waits for a pair that will never connect."""
    done = asyncio.ensure_future(call.sent())  # the confirmation and an OK status, or the prefill worker's error
    done.add_done_callback(_read_outcome)
    try:
        either: list[asyncio.Future[Any]] = [receive, done]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if receive.done():
            nbytes = receive.result()  # raises the TransferError
            await done
            return nbytes
        await done
        return await asyncio.shield(receive)  # it confirmed the transfer; the receive is ending too
    finally:
        done.cancel()
        await asyncio.wait([done])  # its read over: the call is read again to end it (PrefillCall.cancel)


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """When one of a transfer's two futures fails first, the other's error goes unread; reading it here keeps
    asyncio from logging it as never retrieved."""
    if not future.cancelled():
        future.exception()
