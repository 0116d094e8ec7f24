"""The public pdserve.v1.Generation service: validate, place, relay the decode worker's stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from pdserve.config import RouterConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.registry.base import PrefixIndex
from pdserve.rpc.convert import sampling_to_pb
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from pdserve.v1 import worker_pb2 as wpb
from services.router.admission import Admission
from services.router.load_tracker import LoadTracker
from services.router.placement import Placement, PlacementPolicy
from services.router.request import RoutedRequest, build_request


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: Tokenizer,
        model: ModelConfig,
        config: RouterConfig,
        placement: PlacementPolicy,
        prefix_index: PrefixIndex,
        tracker: LoadTracker,
    ) -> None:
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

    def admit(self, req: RoutedRequest) -> Placement:
        """Place and admit, or raise (UnavailableError, OverloadedError) before anything is sent."""
        if self.draining:
            raise UnavailableError("the router is draining; retry on another replica")
        ttft_ms, tpot_ms = self.config.slo_for(req.priority, req.ttft_slo_ms, req.tpot_slo_ms)
        placement = self.placement.place(req.prompt_token_ids, req.sampling.max_tokens, tpot_ms / 1e3)
        headroom = self.config.slo_headroom / 1e3  # predictions are seconds; keep a margin for the unmodelled
        slo_s = (ttft_ms * headroom, tpot_ms * headroom)
        self.admission.check(placement, len(req.prompt_token_ids), req.priority, slo_s)
        return placement

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        start = time.perf_counter()
        req = build_request(request, self.tokenizer, self.model, self.config.default_max_tokens)
        placement = self.admit(req)
        prefill, decode = placement.prefill_worker, placement.decode
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
        try:
            async for msg in call:
                if not ttft_ms and msg.token_ids:
                    ttft_ms = (time.perf_counter() - start) * 1e3
                    self.tracker.prefilled(
                        prefill.worker_id, decode.worker_id, new_tokens, own_s, placement.blocks_needed
                    )
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
                yield msg
        except grpc.aio.AioRpcError as e:
            raise _from_worker(e, decode.address) from e
        finally:
            call.cancel()  # a no-op once finished; on client cancel or error it frees the worker's blocks
            if not ttft_ms:
                self.tracker.prefilled(prefill.worker_id, decode.worker_id, new_tokens, own_s, placement.blocks_needed)
            self.tracker.finished(decode.worker_id)
            self.admission.in_flight -= 1

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        if address not in self._stubs:
            self._stubs[address] = worker_pb2_grpc.DecodeWorkerStub(channel(address))
        return self._stubs[address]


def _from_worker(e: grpc.aio.AioRpcError, address: str) -> Exception:
    """A worker's status, re-raised as the typed error the interceptor maps back to the same code."""
    detail = f"worker {address}: {e.details()}"
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError("request", detail)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(detail)
    return UnavailableError(detail)
