"""DecodeWorker gRPC service: reserve blocks, have a prefill worker fill them, decode and stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import OverloadedError, UnavailableError
from pdserve.rpc.convert import output_to_pb, sampling_from_pb
from pdserve.rpc.server import channel
from pdserve.telemetry import Telemetry, now_ns, request_id_var
from pdserve.transfer.base import KVReceiver, TransferError
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
    ) -> None:
        self.telemetry = telemetry or Telemetry(f"pdserve-{role}")
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.role = role
        self._tags = itertools.count(1)
        self._prefill_stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}

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
        blocks = await self.engine.call(lambda e: e.reserve(request_id, prompt, sampling))
        if blocks is None:
            raise OverloadedError(f"decode worker {self.worker_id} has no free KV blocks for {len(prompt)} tokens")
        try:
            first_token, cached = await self._remote_prefill(request, blocks, context)
        except BaseException:
            await self.engine.abort(request_id)
            raise
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
        cache served, once the KV is in place."""
        assert self.receiver is not None
        peer = request.prefill_address
        timeout_s = min(context.time_remaining() or DEFAULT_TRANSFER_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S)
        tag = next(self._tags)
        rendezvous = await asyncio.to_thread(self.receiver.rendezvous, peer)
        engine = self.engine.engine
        prefill = wpb.PrefillRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            target=wpb.KVTarget(decode_worker_id=self.worker_id, rendezvous=rendezvous, block_ids=blocks, tag=tag),
            layout=wpb.KVLayout(model_fingerprint=engine.fingerprint, block_size=engine.config.block_size),
            transfer_timeout_ms=int(timeout_s * 1e3),
        )
        receive: asyncio.Future[int] | None = None
        first: wpb.FirstToken | None = None
        received_from_ns = 0
        call = self._prefill_stub(peer).Prefill(prefill, timeout=context.time_remaining())
        try:
            async for event in call:
                if event.HasField("first_token"):
                    first = event.first_token
                    if first.kv_follows:
                        caches = engine.runner.kv_caches
                        received_from_ns = now_ns()
                        receive = asyncio.ensure_future(
                            asyncio.to_thread(self.receiver.recv, peer, tag, caches, blocks, timeout_s)
                        )
            if first is None:
                raise UnavailableError(f"prefill worker {peer} ended without a first token")
            if receive is not None:
                nbytes = await asyncio.shield(receive)
                self.telemetry.span(
                    "kv_transfer.recv",
                    received_from_ns,
                    now_ns(),
                    request__id=request.request_id,
                    worker__id=self.worker_id,
                    kv__blocks=len(blocks),
                    kv__bytes=nbytes if isinstance(nbytes, int) else None,
                )
        except TransferError as e:
            raise UnavailableError(f"KV transfer from {peer} failed: {e}") from e
        except grpc.aio.AioRpcError as e:
            raise UnavailableError(f"prefill worker {peer}: {e.code().name}: {e.details()}") from e
        finally:
            call.cancel()  # no-op once finished; on our caller's cancel it stops the prefill too
            # The blocks may be freed only once nothing writes into them any more.
            if receive is not None and not receive.done():
                await asyncio.wait([receive])
        return first.token_id, first.cached_prompt_tokens

    def _prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._prefill_stubs:
            ch = channel(address, self.telemetry.client_interceptors())
            self._prefill_stubs[address] = worker_pb2_grpc.PrefillWorkerStub(ch)
        return self._prefill_stubs[address]

    async def Stats(  # noqa: N802
        self, request: wpb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStats:
        return wpb.WorkerStats(worker_id=self.worker_id, role=self.role, **self.engine.stats)


def _with_cached(msg: pb.GenerateResponse, last: bool, cached_tokens: int) -> pb.GenerateResponse:
    """The last message reports how much of the prompt the prefill side's prefix cache served."""
    if last:
        msg.usage.cached_prompt_tokens = cached_tokens
    return msg
