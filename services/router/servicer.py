"""The public pdserve.v1.Generation service: validate, place, relay the decode worker's stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.rpc.convert import sampling_to_pb
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from pdserve.v1 import worker_pb2 as wpb
from services.router.placement import PlacementPolicy
from services.router.request import build_request


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self, tokenizer: Tokenizer, model: ModelConfig, placement: PlacementPolicy, default_max_tokens: int = 256
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.placement = placement
        self.default_max_tokens = default_max_tokens
        self.draining = False
        self.in_flight = 0
        self._stubs: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        start = time.perf_counter()
        req = build_request(request, self.tokenizer, self.model, self.default_max_tokens)
        if self.draining:
            raise UnavailableError("the router is draining; retry on another replica")
        placement = self.placement.place(len(req.prompt_token_ids))
        forward = wpb.WorkerGenerateRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_pb(req.sampling),
            prefill_address=placement.prefill.address if placement.prefill else "",
        )
        call = self._stub(placement.decode.address).Generate(forward, timeout=context.time_remaining())
        self.in_flight += 1
        ttft_ms = 0.0
        completion_tokens = 0
        try:
            async for msg in call:
                if not ttft_ms and msg.token_ids:
                    ttft_ms = (time.perf_counter() - start) * 1e3
                completion_tokens += len(msg.token_ids)
                msg.request_id = req.request_id
                if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    msg.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=completion_tokens,
                            ttft_ms=ttft_ms,
                        )
                    )
                yield msg
        except grpc.aio.AioRpcError as e:
            raise _from_worker(e, placement.decode.address) from e
        finally:
            call.cancel()  # a no-op once finished; on client cancel or error it frees the worker's blocks
            self.in_flight -= 1
            self.placement.release(placement)

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
