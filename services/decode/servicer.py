"""DecodeWorker gRPC service: reserve blocks, have a prefill worker fill them, decode and stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import OverloadedError, UnavailableError
from pdserve.rpc.convert import output_to_pb, sampling_from_pb
from pdserve.rpc.server import channel
from pdserve.telemetry import Telemetry, now_ns, request_id_var
from pdserve.transfer.base import KVReceiver, TransferError, TransferTimeoutError
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Also the colocated worker: a request with no prefill address is prefilled here (mixed engine)."""

    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver | None,
        worker_id: str,
        role: str,
        telemetry: Telemetry | None = None,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        self.telemetry = telemetry or Telemetry(f"pdserve-{role}")
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.role = role
        self.transfer_timeout_s = transfer_timeout_s
        self._tags = itertools.count(1)
        self._prefill_stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._freeing: set[asyncio.Future[None]] = set()

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id
        request_id_var.set(request_id)
        prompt = list(request.prompt_token_ids)
        sampling = sampling_from_pb(request.sampling, default_max_tokens=16)
        ids = {"request.id": request_id, "worker.id": self.worker_id}
        if not request.prefill_address:
            # Not made current: a span context entered across `yield`s can be left from another context.
            span = self.telemetry.tracer.start_span("decode.stream", attributes=ids)
            tokens = 0
            try:
                async for out in self.engine.generate(request_id, prompt, sampling):
                    tokens += len(out.new_token_ids)
                    yield _with_cached(output_to_pb(out), out.finished, out.num_cached_tokens)
            finally:
                span.set_attribute("completion_tokens", tokens)
                span.end()
            return
        if self.receiver is None:
            raise UnavailableError(f"worker {self.worker_id} ({self.role}) takes no KV hand-offs")
        try:
            blocks = await self.engine.call(lambda e: e.reserve(request_id, prompt, sampling))
        except asyncio.CancelledError:
            await self.engine.abort(request_id)  # the reserve runs all the same: undo it
            raise
        if blocks is None:
            raise OverloadedError(f"decode worker {self.worker_id} has no free KV blocks for {len(prompt)} tokens")
        first_token, cached = await self._remote_prefill(request, blocks, context)  # frees `blocks` if it fails
        committed_ns = now_ns()
        tokens = 0
        # The stream span starts when the sequence joins the batch; it is opened by hand because that
        # moment (the first step that runs it) is known only after the first decoded token arrives.
        stream = None
        try:
            async for out in self.engine.commit_and_stream(request_id, first_token):
                tokens += len(out.new_token_ids)
                if stream is None and tokens > 1:
                    ran_ns = self.engine.take_started_ns(request_id) or committed_ns
                    self.telemetry.span("decode.queue_wait", committed_ns, ran_ns, **ids)
                    stream = self.telemetry.tracer.start_span("decode.stream", start_time=ran_ns, attributes=ids)
                yield _with_cached(output_to_pb(out), out.finished, cached)
        finally:
            if stream is None:
                stream = self.telemetry.tracer.start_span("decode.stream", start_time=committed_ns, attributes=ids)
            stream.set_attribute("completion_tokens", tokens)
            stream.set_attribute("prompt_tokens", len(prompt))
            stream.end()
            log.debug("decode finished", extra={"completion_tokens": tokens})

    async def _remote_prefill(
        self, request: wpb.WorkerGenerateRequest, blocks: list[int], context: grpc.aio.ServicerContext
    ) -> tuple[int, int]:
        """Ask the prefill worker to fill `blocks`; returns the first token and the prompt tokens its prefix
        cache served, once the KV is in place. Fails as soon as the transfer or the prefill worker fails, and
        then frees `blocks`: at once, or, while a receive may still write into them, when that receive ends."""
        assert self.receiver is not None
        request_id, peer = request.request_id, request.prefill_address
        timeout_s = min(context.time_remaining() or self.transfer_timeout_s, self.transfer_timeout_s)
        tag = next(self._tags)
        engine = self.engine.engine
        receive: asyncio.Future[int] | None = None
        call: grpc.aio.UnaryStreamCall | None = None
        try:
            rendezvous = await asyncio.to_thread(self.receiver.rendezvous, peer)
            prefill = wpb.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                target=wpb.KVTarget(decode_worker_id=self.worker_id, rendezvous=rendezvous, block_ids=blocks, tag=tag),
                layout=wpb.KVLayout(model_fingerprint=engine.fingerprint, block_size=engine.config.block_size),
                transfer_timeout_ms=int(timeout_s * 1e3),
            )
            call = self._prefill_stub(peer).Prefill(prefill, timeout=context.time_remaining())
            event = await call.read()
            if event is grpc.aio.EOF or not event.HasField("first_token"):
                raise UnavailableError(f"prefill worker {peer} ended without a first token")
            first = event.first_token
            if first.kv_follows:
                received_from_ns = now_ns()
                caches = engine.runner.kv_caches
                receive = asyncio.ensure_future(
                    asyncio.to_thread(self.receiver.recv, peer, tag, caches, blocks, timeout_s)
                )
                receive.add_done_callback(_read_outcome)
                nbytes = await _until_transferred(call, receive)
                self.telemetry.span(
                    "kv_transfer.recv",
                    received_from_ns,
                    now_ns(),
                    request__id=request_id,
                    worker__id=self.worker_id,
                    kv__blocks=len(blocks),
                    kv__bytes=nbytes,
                )
            else:
                await _to_end(call)
            return first.token_id, first.cached_prompt_tokens
        except BaseException as e:
            await self._free(request_id, receive)
            if isinstance(e, TransferTimeoutError):
                raise UnavailableError(f"KV transfer from {peer} timed out after {timeout_s:g}s: {e}") from e
            if isinstance(e, TransferError):
                raise UnavailableError(f"KV transfer from {peer} failed: {e}") from e
            if isinstance(e, grpc.aio.AioRpcError):
                raise UnavailableError(f"prefill worker {peer}: {e.code().name}: {e.details()}") from e
            raise
        finally:
            if call is not None:
                call.cancel()  # no-op once finished; on our caller's cancel it stops the prefill too

    async def _free(self, request_id: str, receive: asyncio.Future[int] | None) -> None:
        """Frees a failed hand-off's blocks once nothing writes into them any more. A receive still waiting
        (its pair not yet connected to a prefill worker that died, say) ends by its own timeout; the request's
        caller hears of the failure now, and the blocks go when the receive ends."""
        if receive is None or receive.done():
            await self.engine.abort(request_id)
            return

        async def when_received() -> None:
            await asyncio.wait([receive])
            await self.engine.abort(request_id)

        task = asyncio.ensure_future(when_received())
        self._freeing.add(task)  # a strong reference until done: the loop keeps only weak ones
        task.add_done_callback(self._freeing.discard)

    def _prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._prefill_stubs:
            ch = channel(address, self.telemetry.client_interceptors())
            self._prefill_stubs[address] = worker_pb2_grpc.PrefillWorkerStub(ch)
        return self._prefill_stubs[address]

    async def Stats(  # noqa: N802
        self, request: wpb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStats:
        return wpb.WorkerStats(worker_id=self.worker_id, role=self.role, pid=os.getpid(), **self.engine.stats)


async def _until_transferred(call: grpc.aio.UnaryStreamCall, receive: asyncio.Future[int]) -> int:
    """The bytes received, once the KV is in place and the prefill worker confirmed it. Whichever side fails
    first fails the transfer: a stalled prefill worker (stream open, no bytes) meets the receive's timeout, a
    lost one its stream's error, even while the receive still waits for a pair that will never connect."""
    done = asyncio.ensure_future(_to_end(call))  # TransferDone and an OK status, or the prefill worker's error
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


async def _to_end(call: grpc.aio.UnaryStreamCall) -> None:
    """Reads the Prefill stream to its status, which raises if the prefill worker failed."""
    while await call.read() is not grpc.aio.EOF:
        pass


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """When one of a transfer's two futures fails first, the other's error goes unread; reading it here keeps
    asyncio from logging it as never retrieved."""
    if not future.cancelled():
        future.exception()


def _with_cached(msg: pb.GenerateResponse, last: bool, cached_tokens: int) -> pb.GenerateResponse:
    """The last message reports how much of the prompt the prefill side's prefix cache served."""
    if last:
        msg.usage.cached_prompt_tokens = cached_tokens
    return msg
