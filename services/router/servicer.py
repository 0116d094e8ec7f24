"""The public pdserve.v1.Generation service: validate, place, relay the decode worker's stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from pdserve.config import RouterConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.metrics import RecentLatencies, RouterMetrics
from pdserve.protocol.model_config import ModelConfig
from pdserve.registry.base import PrefixIndex
from pdserve.rpc.convert import sampling_to_pb
from pdserve.rpc.errors import error_from_rpc
from pdserve.rpc.server import channel
from pdserve.telemetry import Telemetry, request_id_var
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from pdserve.v1 import worker_pb2 as wpb
from services.router.admission import Admission
from services.router.load_tracker import LoadTracker
from services.router.placement import Placement, PlacementPolicy
from services.router.request import RoutedRequest, build_request

log = logging.getLogger(__name__)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: Tokenizer,
        model: ModelConfig,
        config: RouterConfig,
        placement: PlacementPolicy,
        prefix_index: PrefixIndex,
        tracker: LoadTracker,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.telemetry = telemetry or Telemetry("pdserve-router")
        self.metrics = RouterMetrics(self.telemetry.meter)
        self.recent = RecentLatencies()
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.placement = placement
        self.prefix_index = prefix_index
        self.tracker = tracker
        self.predictor = placement.predictor
        self.admission = Admission(config, self.predictor)
        self.draining = False
        self._stubs: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    async def admit(self, req: RoutedRequest) -> Placement:
        """Place and admit, or raise (UnavailableError, OverloadedError) before anything is sent."""
        if self.draining:
            raise UnavailableError("the router is draining; retry on another replica")
        ttft_ms, tpot_ms = self.config.slo_for(req.priority, req.ttft_slo_ms, req.tpot_slo_ms)
        with self.telemetry.tracer.start_as_current_span("placement") as span:
            placement = await self.placement.place(req.prompt_token_ids, req.sampling.max_tokens, tpot_ms / 1e3)
            span.set_attribute("prefill.worker.id", placement.prefill_worker.worker_id)
            span.set_attribute("decode.worker.id", placement.decode.worker_id)
            span.set_attribute("cached_tokens", placement.cached_tokens)
            span.set_attribute("predicted_ttft_s", placement.predicted_ttft_s)
        headroom = self.config.slo_headroom / 1e3  # predictions are seconds; keep a margin for the unmodelled
        slo_s = (ttft_ms * headroom, tpot_ms * headroom)
        self.admission.check(placement, len(req.prompt_token_ids), req.priority, slo_s)
        return placement

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        start = time.perf_counter()
        outcome = "failed"
        request_id_var.set(request.request_id or None)
        try:
            async for msg in self._generate(request, context, start):
                yield msg
            outcome = "finished"
        except InvalidRequestError:
            outcome = "invalid"
            raise
        except OverloadedError:
            outcome = "rejected"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except TimeoutError:
            outcome = "cancelled"  # the deadline passed: the client gave up on it
            raise
        finally:
            self.metrics.requests.add(1, {"outcome": outcome})
            e2e_s = time.perf_counter() - start
            if outcome == "finished":
                self.metrics.e2e.record(e2e_s)
            log.info("request %s", outcome, extra={"outcome": outcome, "e2e_ms": round(e2e_s * 1e3, 2)})

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, start: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        tracer = self.telemetry.tracer
        with tracer.start_as_current_span("admission") as span:
            req = await build_request(request, self.tokenizer, self.model, self.config.default_max_tokens)
            request_id_var.set(req.request_id)
            span.set_attribute("request.id", req.request_id)
            span.set_attribute("prompt_tokens", len(req.prompt_token_ids))
            try:
                placement = await self.admit(req)
            except OverloadedError as e:
                span.set_attribute("rejected", str(e))
                raise
        prefill, decode = placement.prefill_worker, placement.decode
        trace.get_current_span().set_attributes(
            {
                "request.id": req.request_id,
                "prefill.worker.id": prefill.worker_id,
                "decode.worker.id": decode.worker_id,
            }
        )
        new_tokens = len(req.prompt_token_ids) - placement.cached_tokens
        own_s = self.predictor.prefill_s(prefill, new_tokens)
        self.prefix_index.record(prefill.worker_id, placement.block_hashes)
        self.tracker.start(prefill.worker_id, decode.worker_id, new_tokens, own_s, placement.blocks_needed)
        self.admission.in_flight += 1
        forward = wpb.WorkerGenerateRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_pb(req.sampling),
            prefill_address=placement.prefill.address if placement.prefill else "",
        )
        call = self._stub(decode.address).Generate(forward, timeout=context.time_remaining())
        ttft_ms = 0.0
        completion_tokens = 0
        last_token_at = 0.0
        try:
            async for msg in call:
                now = time.perf_counter()
                if not ttft_ms and msg.token_ids:
                    ttft_ms = (now - start) * 1e3
                    self.metrics.ttft.record(ttft_ms / 1e3)
                    for worker_id in {prefill.worker_id, decode.worker_id}:
                        self.recent.add(worker_id, "ttft", ttft_ms / 1e3)
                    self.tracker.prefilled(
                        prefill.worker_id, decode.worker_id, new_tokens, own_s, placement.blocks_needed
                    )
                elif msg.token_ids:
                    self.metrics.itl.record(now - last_token_at)
                if msg.token_ids:
                    last_token_at = now
                completion_tokens += len(msg.token_ids)
                msg.request_id = req.request_id
                if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    msg.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=completion_tokens,
                            ttft_ms=ttft_ms,
                            cached_prompt_tokens=msg.usage.cached_prompt_tokens,
                        )
                    )
                    if completion_tokens > 1:
                        tpot_s = (now - start - ttft_ms / 1e3) / (completion_tokens - 1)
                        self.metrics.tpot.record(tpot_s)
                        self.recent.add(decode.worker_id, "tpot", tpot_s)
                    trace.get_current_span().set_attribute("completion_tokens", completion_tokens)
                yield msg
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"decode worker {decode.address}") from e
        finally:
            call.cancel()  # a no-op once finished; on client cancel or error it frees the worker's blocks
            if not ttft_ms:
                self.tracker.prefilled(prefill.worker_id, decode.worker_id, new_tokens, own_s, placement.blocks_needed)
            self.tracker.finished(decode.worker_id)
            self.admission.in_flight -= 1

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        if address not in self._stubs:
            ch = channel(address, self.telemetry.client_interceptors())
            self._stubs[address] = worker_pb2_grpc.DecodeWorkerStub(ch)
        return self._stubs[address]
