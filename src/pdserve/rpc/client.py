"""A small client of the public Generate API, with client-side TTFT and TPOT."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    messages: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    usage: pb.Usage | None = None
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # when the request asked for them
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # when the request asked for them

    @property
    def tpot_s(self) -> float:
        """(e2e - TTFT) / (output tokens - 1), as vLLM's benchmarks define it."""
        n = len(self.token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


async def generate(
    address: str,
    request: pb.GenerateRequest,
    timeout_s: float | None = None,
    credentials: ClientCredentials | None = None,
) -> AsyncGenerator[tuple[pb.GenerateResponse, StreamResult], None]:
    """Yields each stream message with the running result (timings filled in as they become known)."""
    result = StreamResult()
    start = time.perf_counter()
    async with channel(address, credentials=credentials) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        metadata = credentials.metadata() if credentials else ()
        async for msg in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            now = time.perf_counter() - start
            if msg.token_ids and not result.token_ids:
                result.ttft_s = now
            result.token_ids += msg.token_ids
            result.logprobs += msg.logprobs
            result.prompt_logprobs += msg.prompt_logprobs
            result.text += msg.text
            result.messages += 1
            result.e2e_s = now
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                result.usage = msg.usage
            yield msg, result
