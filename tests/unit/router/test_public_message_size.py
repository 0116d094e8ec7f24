"""The public gRPC port takes no message larger than a valid request can be (a real in-process router on loopback,
tiny-random, an API-key file, no workers): a larger one is gRPC's own RESOURCE_EXHAUSTED before any key check, where
16 MiB messages from callers without a key were buffered whole (40 parallel ones: 846 MB). A logit_bias past its
cap is refused by its count before any entry is converted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.protocol.request_checks import RequestLimits
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.security.api_keys import bearer_metadata, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router import request as router_request
from services.router.request_size import MIN_REQUEST_BYTES
from services.router.server import RouterServer, start_router

pytestmark = pytest.mark.timeout(60)
KEY = "size-key"


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterServer]:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "k"\nsha256 = "{digest(KEY)}"\ntenant = "t"\n')
    config = RouterConfig(api_keys_file=str(keys), no_workers_wait_s=0.1)
    telemetry = Telemetry("pdserve-router", enabled=False)
    server, _ = await start_router(
        "tiny-random", InMemoryRegistry(), InMemoryPrefixIndex(), config, "127.0.0.1", 0, telemetry
    )
    yield server
    await server.stop(None)


async def generate(address: str, msg: pb.GenerateRequest, key: str | None) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = generate_pb2_grpc.GenerationStub(ch).Generate(msg, metadata=bearer_metadata(key), timeout=20)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def test_a_message_past_what_a_valid_request_holds_is_refused_before_the_key_check(router) -> None:
    small, large = pb.GenerateRequest(prompt="hi"), pb.GenerateRequest(prompt="x" * (MIN_REQUEST_BYTES + 1))
    assert (await generate(router.address, small, None))[0] == grpc.StatusCode.UNAUTHENTICATED
    for key in (None, KEY):
        code, details = await generate(router.address, large, key)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "larger than max" in details  # gRPC's own refusal, not admission's


async def test_a_logit_bias_past_its_cap_is_refused_by_its_count_before_any_entry_is_converted(
    router, monkeypatch
) -> None:
    def converted(*args: object, **kwargs: object) -> None:
        raise AssertionError("logit_bias converted before its count was checked")

    monkeypatch.setattr(router_request, "sampling_from_pb", converted)  # called, the request would be INTERNAL
    entries = RequestLimits().max_logit_bias + 1
    msg = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(logit_bias=dict.fromkeys(range(entries), 1.0)))
    code, details = await generate(router.address, msg, KEY)
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"sampling.logit_bias: {entries} token ids; at most {entries - 1}",
    )
    msg.sampling.logit_bias.update(dict.fromkeys(range(10**6), 1.0))  # ~11 MB: gRPC's refusal, never parsed
    assert (await generate(router.address, msg, KEY))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
