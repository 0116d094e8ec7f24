"""Both front ends of a real in-process router (gRPC and HTTP on loopback, tiny-random's tokenizer, no workers):
the caller's headers reach the one check from either protocol, and its refusals and the lifecycle's keep their
meaning on each (401/UNAUTHENTICATED for no key or an unknown one, 403/PERMISSION_DENIED for a priority above the
key's cap, 503/UNAVAILABLE when no worker can serve), with a real API-key file."""

from __future__ import annotations

import hashlib

import grpc
import httpx2
import pytest

from pdserve.config import RouterConfig
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.server import start_router

TYPES = {401: "invalid_request_error", 403: "permission_error", 503: "service_unavailable_error"}
KEY = "good-key"


@pytest.fixture
async def router(tmp_path):
    server = await keyed_router(tmp_path)
    yield server
    await server.stop(None)


async def keyed_router(tmp_path):
    keys = tmp_path / "keys.toml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    keys.write_text(f'[[keys]]\nname = "k"\nsha256 = "{digest}"\ntenant = "team-a"\nmax_priority = 0\n')
    server, _ = await start_router(
        "tiny-random",
        InMemoryRegistry(),
        InMemoryPrefixIndex(),
        RouterConfig(api_keys_file=str(keys), no_workers_wait_s=0.1),
        "127.0.0.1",
        0,
        Telemetry("pdserve-router", enabled=False),
        http_port=0,
    )
    return server


async def grpc_status(address: str, metadata: tuple = (), priority: int = 0) -> grpc.StatusCode:
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2), priority=priority)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async with grpc.aio.insecure_channel(address) as ch:
            async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(request, metadata=metadata, timeout=10):
                pass
    return e.value.code()


@pytest.mark.parametrize(
    ("key", "priority", "status", "code"),
    [
        (None, 0, 401, grpc.StatusCode.UNAUTHENTICATED),
        ("Bearer wrong-key", 0, 401, grpc.StatusCode.UNAUTHENTICATED),
        (f"Bearer {KEY}", 1, 403, grpc.StatusCode.PERMISSION_DENIED),  # above the key's max_priority
        (f"Bearer {KEY}", 0, 503, grpc.StatusCode.UNAVAILABLE),  # let in; no worker to serve it
    ],
)
async def test_one_caller_check_covers_both_protocols(router, key, priority, status, code):
    headers = {"authorization": key} if key else {}
    base = f"http://{router.http.address}"
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2, "priority": priority}
    async with httpx2.AsyncClient(base_url=base, timeout=10) as http:
        for stream in (False, True):
            r = await http.post("/v1/completions", json=body | {"stream": stream}, headers=headers)
            assert r.status_code == status, r.text
            assert r.json()["error"]["type"] == TYPES[status]
        unreadable = await http.post("/v1/completions", content=b"{not json", headers=headers)
        assert unreadable.status_code == (401 if status == 401 else 400)  # the key is checked before the body
        models = await http.get("/v1/models", headers=headers)
        assert models.status_code == (401 if status == 401 else 200)
    assert await grpc_status(router.address, tuple(headers.items()), priority) == code


async def test_a_refused_key_is_told_in_each_protocols_terms(router):
    """No key: HTTP names its header, gRPC its metadata; an unknown key is OpenAI's `invalid_api_key`."""
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2}
    async with httpx2.AsyncClient(base_url=f"http://{router.http.address}", timeout=10) as http:
        missing = (await http.post("/v1/completions", json=body)).json()["error"]
        unknown = (await http.post("/v1/completions", json=body, headers={"authorization": "Bearer no"})).json()
    assert "the header `Authorization: Bearer KEY`" in missing["message"] and missing["code"] is None
    assert unknown["error"]["code"] == "invalid_api_key"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async with grpc.aio.insecure_channel(router.address) as ch:
            request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
            async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=10):
                pass
    assert "send metadata `authorization: Bearer KEY`" in e.value.details()


async def test_an_unknown_callers_message_is_never_parsed(tmp_path, monkeypatch):
    """As the HTTP API reads no body before the key check: a 4 MiB message of token ids held the router's loop
    ~10 ms to parse for a caller with no key (the public port now takes at most 1 MiB at tiny-random's context:
    test_public_message_size.py). A known caller's is parsed as ever; two keys are no known caller."""
    parsed, from_string = [], pb.GenerateRequest.FromString

    def parse(data: bytes) -> pb.GenerateRequest:
        request = from_string(data)
        parsed.append(request.request_id)
        return request

    monkeypatch.setattr(pb.GenerateRequest, "FromString", parse)  # what the servicer's registration reads
    router = await keyed_router(tmp_path)
    large = pb.GenerateRequest(prompt_token_ids=[7] * (2**18), sampling=pb.SamplingParams(max_tokens=2))
    try:
        async with grpc.aio.insecure_channel(router.address) as ch:
            # A key sent twice is refused, whichever comes last: the check before parsing reads them all.
            good, wrong = ("authorization", f"Bearer {KEY}"), ("authorization", "Bearer wrong-key")
            for i, metadata in enumerate(((), (wrong,), (good,), (wrong, good), (good, wrong))):
                large.request_id = str(i)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(large, metadata=metadata, timeout=10):
                        pass
                known = metadata == (good,)
                code = grpc.StatusCode.INVALID_ARGUMENT if known else grpc.StatusCode.UNAUTHENTICATED
                assert e.value.code() == code, (metadata, e.value.details())
    finally:
        await router.stop(None)
    assert parsed == ["2"]  # the known caller's only: the prompt is past the context, so refused
