"""A burst far beyond capacity on the real model: some requests admitted, the rest shed at once."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BURST, PROMPT_TOKENS, TTFT_SLO_MS = 100, 500, 3000.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("burst") / "cluster.log"
    proc = ClusterProcess(
        "--model", "smollm2-135m", "--mode", "disaggregated", "--prefill", "1", "--decode", "1", log_path=log
    )
    yield proc
    proc.stop()


def test_burst_admits_what_fits_and_sheds_the_rest_fast(cluster):
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)] for _ in range(BURST)]

    async def burst():
        async with channel(cluster.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)

            async def one(prompt):
                start = time.perf_counter()
                request = pb.GenerateRequest(
                    prompt_token_ids=prompt,
                    sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
                    slo=pb.SLO(ttft_ms=TTFT_SLO_MS),
                )
                ttft = None
                try:
                    async for msg in stub.Generate(request, timeout=120):
                        if msg.token_ids and ttft is None:
                            ttft = time.perf_counter() - start
                except grpc.aio.AioRpcError as e:
                    meta = dict(e.trailing_metadata() or ())
                    meta["details"] = e.details()
                    return e.code().name, time.perf_counter() - start, meta
                return "ok", ttft, {}

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(burst())
    admitted = [t for status, t, _ in results if status == "ok"]
    shed = [(t, meta) for status, t, meta in results if status == "RESOURCE_EXHAUSTED"]
    others = [status for status, _, _ in results if status not in ("ok", "RESOURCE_EXHAUSTED")]
    print(
        f"admitted {len(admitted)}, shed {len(shed)}, TTFTs {sorted(round(t, 2) for t in admitted)}, "
        f"slowest rejection {max(t for t, _ in shed) * 1e3:.0f} ms"
    )
    assert not others, others
    assert admitted and shed
    assert max(t for t, _ in shed) < 0.2
    assert all(int(meta["grpc-retry-pushback-ms"]) >= 100 for _, meta in shed)
    met = sum(t <= TTFT_SLO_MS / 1e3 for t in admitted)
    assert met >= 0.95 * len(admitted), sorted(admitted)
