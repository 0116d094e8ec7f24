"""A schema or regex compiles off the event loop whatever its size, on a real in-process router (gRPC and HTTP on
loopback, no workers): its cost follows its structure, and a 3 KB schema of `allOf` over `anyOf`s, which went inline
as under 4 KiB, held the router's loop 0.4-0.9 s per request, every other caller's stream and probe with it."""

from __future__ import annotations

import json
import time

import grpc
import httpx2
import pytest

from pdserve.config import RouterConfig
from pdserve.protocol.output_constraint import OutputConstraint
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.server import start_router
from tests.loop_gaps import longest_loop_gap

pytestmark = pytest.mark.timeout(60)


def _one_of_nine(j: int) -> dict[str, object]:
    names = [f"{j}_{i}" for i in range(9)]
    return {"anyOf": [{"type": "object", "properties": {n: {"type": "integer"}}, "required": [n]} for n in names]}


# Four objects, each one of nine shapes: llguidance works through their combinations (just within "schema too large").
COSTLY = json.dumps({"allOf": [_one_of_nine(j) for j in range(4)]})


@pytest.fixture(scope="module")
def compile_s() -> float:
    """What one compile of COSTLY takes on this machine, timed on a thread as the router should run it."""
    assert len(COSTLY) < 4096  # small: the size rule let it run on the loop
    start = time.perf_counter()
    OutputConstraint("json_schema", COSTLY)
    took = time.perf_counter() - start
    assert took > 0.05, f"COSTLY compiled in {took:.3f} s: too cheap to show a stall"
    return took


@pytest.fixture
async def router():
    server, _ = await start_router(
        "tiny-random",
        InMemoryRegistry(),
        InMemoryPrefixIndex(),
        RouterConfig(no_workers_wait_s=0.1),
        "127.0.0.1",
        0,
        Telemetry("pdserve-router", enabled=False),
        http_port=0,
    )
    yield server
    await server.stop(None)


async def test_a_costly_schema_over_grpc_leaves_the_router_loop_running(router, compile_s):
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2, json_schema=COSTLY))

    async def ask() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async with grpc.aio.insecure_channel(router.address) as ch:
                async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=30):
                    pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value  # compiled, then no worker to serve it

    assert (await longest_loop_gap(ask))[0] < compile_s / 2


async def test_a_costly_schema_over_http_leaves_the_router_loop_running(router, compile_s):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(COSTLY)}}
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2, "response_format": schema}

    async def ask() -> None:
        async with httpx2.AsyncClient(base_url=f"http://{router.http.address}", timeout=30) as http:
            r = await http.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text

    assert (await longest_loop_gap(ask))[0] < compile_s / 2
