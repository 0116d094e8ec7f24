"""PrefillWorker gRPC service: run the prompt, hand its KV blocks to the decode worker, free them."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.config import FaultConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import UnavailableError
from pdserve.metrics import WorkerMetrics
from pdserve.rpc.convert import sampling_from_pb
from pdserve.telemetry import Telemetry, now_ns, request_id_var
from pdserve.transfer.base import KVSender, TransferError
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        sender: KVSender,
        worker_id: str,
        telemetry: Telemetry | None = None,
        metrics: WorkerMetrics | None = None,
        faults: FaultConfig | None = None,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.telemetry = telemetry or Telemetry("pdserve-prefill")
        self.metrics = metrics
        self.faults = faults or FaultConfig()  # none injected

    async def Prefill(  # noqa: N802 (gRPC method name)
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.PrefillEvent]:
        fingerprint = self.engine.engine.fingerprint
        if request.layout.model_fingerprint and request.layout.model_fingerprint != fingerprint:
            raise UnavailableError(
                f"model mismatch: decode runs {request.layout.model_fingerprint}, this prefill worker {fingerprint}"
            )
        request_id = request.request_id
        request_id_var.set(request_id)
        sampling = sampling_from_pb(request.sampling, default_max_tokens=1)
        start = time.perf_counter()
        start_ns = now_ns()
        out = await self.engine.prefill(request_id, list(request.prompt_token_ids), sampling)
        prefill_ms = (time.perf_counter() - start) * 1e3
        end_ns = now_ns()
        ran_ns = self.engine.take_started_ns(request_id) or start_ns
        ids = {"request__id": request_id, "worker__id": self.worker_id}
        self.telemetry.span("prefill.queue_wait", start_ns, ran_ns, **ids)
        self.telemetry.span(
            "prefill.compute",
            ran_ns,
            end_ns,
            **ids,
            prompt_tokens=len(request.prompt_token_ids),
            cached_prompt_tokens=out.num_cached_tokens,
        )
        log.debug(
            "prefilled", extra={"prompt_tokens": len(request.prompt_token_ids), "prefill_ms": round(prefill_ms, 2)}
        )
        first = wpb.PrefillEvent(
            first_token=wpb.FirstToken(
                token_id=out.new_token_ids[0],
                kv_follows=not out.finished,
                cached_prompt_tokens=out.num_cached_tokens,
                queue_ms=(ran_ns - start_ns) / 1e6,
                prefill_ms=prefill_ms,
            )
        )
        if out.finished:
            yield first
            return
        try:
            yield first
            if delay_s := self.faults.kv_send_delay_for(request_id):
                await asyncio.sleep(delay_s)
            done = await self._send(request_id, request.target, request.transfer_timeout_ms / 1e3)
        finally:
            # The blocks wait for the hand-off from the first token on: freed however it ends (sent, failed, or
            # cancelled by a decode side that gave up, as during a stall before the send).
            await self.engine.call(lambda e: e.release(request_id))
        yield done  # after the release: the decode side may end the call once it has this

    async def _send(self, request_id: str, target: wpb.KVTarget, timeout_s: float) -> wpb.PrefillEvent:
        """Returns only once the send thread is done with the blocks, even when the caller cancels."""
        send: asyncio.Future[int] | None = None
        try:
            blocks = await self.engine.call(lambda e: e.handoff_blocks(request_id))
            if len(blocks) != len(target.block_ids):
                raise UnavailableError(f"decode side reserved {len(target.block_ids)} blocks, prompt has {len(blocks)}")
            caches = self.engine.engine.runner.kv_caches
            start = time.perf_counter()
            with self.telemetry.tracer.start_as_current_span(
                "kv_transfer.send",
                attributes={
                    "request.id": request_id,
                    "worker.id": self.worker_id,
                    "decode.worker.id": target.decode_worker_id,
                    "kv.blocks": len(blocks),
                },
            ) as span:
                send = asyncio.ensure_future(
                    asyncio.to_thread(
                        self.sender.send, target.rendezvous, target.tag, caches, blocks, timeout_s or 30.0
                    )
                )
                nbytes = await asyncio.shield(send)
                span.set_attribute("kv.bytes", nbytes)
            seconds = time.perf_counter() - start
            if self.metrics is not None:
                self.metrics.transfer_bytes.add(nbytes, self.metrics.labels)
                self.metrics.transfer_seconds.record(seconds, self.metrics.labels)
            log.debug("kv sent", extra={"bytes": nbytes, "transfer_ms": round(seconds * 1e3, 2)})
            return wpb.PrefillEvent(transfer_done=wpb.TransferDone(bytes=nbytes, transfer_ms=seconds * 1e3))
        except TransferError as e:
            raise UnavailableError(f"KV transfer to decode worker {target.decode_worker_id} failed: {e}") from e
        finally:
            if send is not None and not send.done():
                await asyncio.wait([send])

    async def Stats(  # noqa: N802
        self, request: wpb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStats:
        return wpb.WorkerStats(worker_id=self.worker_id, role="prefill", pid=os.getpid(), **self.engine.stats)
