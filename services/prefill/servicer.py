"""PrefillWorker gRPC service: run the prompt, hand its KV blocks to the decode worker, free them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import UnavailableError
from pdserve.rpc.convert import sampling_from_pb
from pdserve.transfer.base import KVSender
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine: AsyncEngine, sender: KVSender, worker_id: str) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id

    async def Prefill(  # noqa: N802 (gRPC method name)
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.PrefillEvent]:
        fingerprint = self.engine.engine.fingerprint
        if request.layout.model_fingerprint and request.layout.model_fingerprint != fingerprint:
            raise UnavailableError(
                f"model mismatch: decode runs {request.layout.model_fingerprint}, this prefill worker {fingerprint}"
            )
        request_id = request.request_id
        sampling = sampling_from_pb(request.sampling, default_max_tokens=1)
        start = time.perf_counter()
        out = await self.engine.prefill(request_id, list(request.prompt_token_ids), sampling)
        prefill_ms = (time.perf_counter() - start) * 1e3
        yield wpb.PrefillEvent(
            first_token=wpb.FirstToken(
                token_id=out.new_token_ids[0],
                kv_follows=not out.finished,
                cached_prompt_tokens=out.num_cached_tokens,
                prefill_ms=prefill_ms,
            )
        )
        if out.finished:
            return
        yield await self._send_and_release(request_id, request.target, request.transfer_timeout_ms / 1e3)

    async def _send_and_release(self, request_id: str, target: wpb.KVTarget, timeout_s: float) -> wpb.PrefillEvent:
        """The blocks are freed only after the send thread is done with them, even when the caller cancels."""
        send: asyncio.Future[int] | None = None
        try:
            blocks = await self.engine.call(lambda e: e.handoff_blocks(request_id))
            if len(blocks) != len(target.block_ids):
                raise UnavailableError(f"decode side reserved {len(target.block_ids)} blocks, prompt has {len(blocks)}")
            caches = self.engine.engine.runner.kv_caches
            start = time.perf_counter()
            send = asyncio.ensure_future(
                asyncio.to_thread(self.sender.send, target.rendezvous, target.tag, caches, blocks, timeout_s or 30.0)
            )
            nbytes = await asyncio.shield(send)
            return wpb.PrefillEvent(
                transfer_done=wpb.TransferDone(bytes=nbytes, transfer_ms=(time.perf_counter() - start) * 1e3)
            )
        finally:
            if send is not None and not send.done():
                await asyncio.wait([send])
            await self.engine.call(lambda e: e.release(request_id))

    async def Stats(  # noqa: N802
        self, request: wpb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStats:
        return wpb.WorkerStats(worker_id=self.worker_id, role="prefill", **self.engine.stats)
