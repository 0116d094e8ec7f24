"""Both front ends of a real in-process router (gRPC and HTTP on loopback, tiny-random's tokenizer, no workers):
the caller's headers reach the one check from either protocol, and its refusals and the lifecycle's keep their
meaning on each (401/UNAUTHENTICATED, 403/PERMISSION_DENIED, 503/UNAVAILABLE when no worker can serve)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import httpx2
import pytest

from pdserve.config import RouterConfig
from pdserve.errors import PermissionDeniedError, UnauthenticatedError
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.server import start_router

TYPES = {401: "authentication_error", 403: "permission_error", 503: "service_unavailable_error"}
KEYS = {"Bearer good": "tenant-a", "Bearer other": None}  # None: a known key without access


def authenticate(headers: Mapping[str, str]) -> str:
    """A stand-in for the API-key check: what it sees is what each front end passed."""
    key = headers.get("authorization")
    if key not in KEYS:
        raise UnauthenticatedError("no valid API key")
    if KEYS[key] is None:
        raise PermissionDeniedError("this key may not generate")
    return KEYS[key]


@pytest.fixture
async def router():
    server, lifecycle = await start_router(
        "tiny-random",
        InMemoryRegistry(),
        InMemoryPrefixIndex(),
        RouterConfig(),
        "127.0.0.1",
        0,
        Telemetry("pdserve-router", enabled=False),
        http_port=0,
    )
    lifecycle.authenticate = authenticate
    yield server
    await server.stop(None)


async def grpc_status(address: str, metadata: tuple = ()) -> grpc.StatusCode:
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async with grpc.aio.insecure_channel(address) as ch:
            async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(request, metadata=metadata, timeout=10):
                pass
    return e.value.code()


@pytest.mark.parametrize(
    ("key", "status", "code"),
    [
        (None, 401, grpc.StatusCode.UNAUTHENTICATED),
        ("Bearer other", 403, grpc.StatusCode.PERMISSION_DENIED),
        ("Bearer good", 503, grpc.StatusCode.UNAVAILABLE),  # let in; no worker to serve it
    ],
)
async def test_one_caller_check_covers_both_protocols(router, key, status, code):
    headers = {"authorization": key} if key else {}
    base = f"http://{router.http.address}"
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2}
    async with httpx2.AsyncClient(base_url=base, timeout=10) as http:
        for stream in (False, True):
            r = await http.post("/v1/completions", json=body | {"stream": stream}, headers=headers)
            assert r.status_code == status, r.text
            assert r.json()["error"]["type"] == TYPES[status]
        models = await http.get("/v1/models", headers=headers)
        assert models.status_code == (200 if status == 503 else status)
    assert await grpc_status(router.address, tuple(headers.items())) == code
