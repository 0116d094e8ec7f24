"""The router keys every hop by its own id: a client's request_id is echoed, never trusted to be unique."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

pytestmark = pytest.mark.timeout(300)
MODES = {
    "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"],
    "colocated": ["--mode", "colocated", "--workers", "1"],
}


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request, tmp_path_factory):
    log = tmp_path_factory.mktemp("identity") / f"{request.param}.log"
    proc = ClusterProcess("--model", "tiny-random", "--kv-cache-gb", "0.05", *MODES[request.param], log_path=log)
    yield proc
    proc.stop()


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_threads=1))
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


async def stream(address: str, request: pb.GenerateRequest) -> tuple[list[int], set[str]]:
    async with channel(address) as ch:
        tokens, ids = [], set()
        async for msg in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60):
            tokens += msg.token_ids
            ids.add(msg.request_id)
        return tokens, ids


def test_two_concurrent_requests_with_one_client_id_both_complete(cluster):
    prompts = [[5, 6, 7, 8] * 10, [40, 41, 42] * 20]
    requests = [
        pb.GenerateRequest(
            request_id="same-id", prompt_token_ids=p, sampling=pb.SamplingParams(max_tokens=24, ignore_eos=True)
        )
        for p in prompts
    ]

    async def both():
        return await asyncio.wait_for(asyncio.gather(*(stream(cluster.address, r) for r in requests)), 60)

    results = asyncio.run(both())
    for p, (tokens, ids) in zip(prompts, results, strict=True):
        assert ids == {"same-id"}  # echoed on every message
        assert tokens == expected(p, 24)
    finished = [line for line in router_log_lines(cluster) if line.get("msg") == "request finished"]
    keys = {line["request_key"] for line in finished if line.get("request_id") == "same-id"}
    assert len(keys) == 2, finished  # logged under the client's id, each with the router's own key


def router_log_lines(cluster: ClusterProcess) -> list[dict]:
    lines = []
    for text in cluster.log().splitlines():
        if text.startswith("{"):
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    return lines


def test_a_request_without_a_client_id_echoes_the_routers_own(cluster):
    request = pb.GenerateRequest(prompt_token_ids=[9, 9, 9], sampling=pb.SamplingParams(max_tokens=3))
    tokens, ids = asyncio.run(stream(cluster.address, request))
    assert len(tokens) == 3
    (only,) = ids
    assert len(only) == 32 and int(only, 16) >= 0  # a uuid4 hex, the same on every message
