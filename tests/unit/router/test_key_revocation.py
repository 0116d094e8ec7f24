"""A key revoked by a reload of the key file ends the streams it opened: a real router on loopback (gRPC and HTTP,
tiny-random's tokenizer, a real key file) and a stand-in decode worker that says which of its calls were cut.
The revoked key's streams end UNAUTHENTICATED / 401 saying the key was revoked (never the key), on gRPC, SSE and a
whole HTTP answer alike, their decode calls cancelled; another key's stream runs to its end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx2
import pytest

from pdserve.config import RouterConfig
from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.errors import UnauthenticatedError
from pdserve.protocol.roles import Role
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from pdserve.v1 import worker_pb2 as wpb
from services.router.key_revocation import KeyedStreams
from services.router.server import start_router
from tests.unit.router.router_builder import MODEL, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
REVOKED, KEPT = "revoked-key-7d1c", "kept-key-03be"
LONG = 1500  # tokens at 20 ms: 30 s, far past the test, unless cut


class CutDecode(StandInDecode):
    """Which calls ended before their last token (their caller cancelled them), by request id."""

    def __init__(self) -> None:
        super().__init__(gap_s=0.02)
        self.cut: set[str] = set()
        self.done: set[str] = set()

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for msg in super().Generate(request, context):
                yield msg
            self.done.add(request.client_request_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.cut.add(request.client_request_id)
            raise


def key_file(path: Path, **tenant_of: str) -> None:
    path.write_text(
        "".join(f'[[keys]]\nname = "{k}"\nsha256 = "{digest(k)}"\ntenant = "{t}"\n' for k, t in tenant_of.items())
    )


@pytest.fixture
async def router(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    keys = tmp_path / "keys.toml"
    key_file(keys, **{REVOKED: "team-r", KEPT: "team-k"})
    decode = CutDecode()
    async with serving(decode) as address:
        registry = InMemoryRegistry(ttl_s=600)
        registry.publish(worker("p0"))
        registry.publish(worker("d0", "decode", address=address))
        config = RouterConfig(api_keys_file=str(keys), no_workers_wait_s=10)
        telemetry = Telemetry("pdserve-router", enabled=False)
        server, lifecycle = await start_router(
            MODEL, registry, InMemoryPrefixIndex(), config, "127.0.0.1", 0, telemetry, http_port=0
        )
        try:
            yield server, lifecycle, decode, keys, registry
        finally:
            await server.stop(None)


async def grpc_stream(address: str, key: str, request_id: str, max_tokens: int, first: asyncio.Event) -> tuple:
    """(status, details, tokens) of one Generate call; `first` set at its first token."""
    request = pb.GenerateRequest(
        prompt="hi", request_id=request_id, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    tokens = 0
    async with grpc.aio.insecure_channel(address) as ch:
        call = generate_pb2_grpc.GenerationStub(ch).Generate(
            request, metadata=(("authorization", f"Bearer {key}"),), timeout=30
        )
        try:
            async for msg in call:
                tokens += len(msg.token_ids)
                first.set()
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), tokens
    return grpc.StatusCode.OK, "", tokens


async def sse_stream(address: str, key: str, request_id: str, first: asyncio.Event) -> list[str]:
    """Every `data:` line of a streamed completion; `first` set at its first."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
    events = []
    async with (
        httpx2.AsyncClient(base_url=f"http://{address}", timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                first.set()
    return events


async def test_a_revoked_keys_open_streams_end_on_both_front_ends_and_another_keys_runs_on(router) -> None:
    server, lifecycle, decode, keys, _ = router
    firsts = [asyncio.Event() for _ in range(3)]
    revoked_grpc = asyncio.create_task(grpc_stream(server.address, REVOKED, "r-grpc", LONG, firsts[0]))
    revoked_sse = asyncio.create_task(sse_stream(server.http.address, REVOKED, "r-sse", firsts[1]))
    kept = asyncio.create_task(grpc_stream(server.address, KEPT, "k-grpc", 150, firsts[2]))  # 3 s
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 10)
    key_file(keys, **{KEPT: "team-k"})
    server.key_reload.reload(lifecycle)
    code, details, tokens = await asyncio.wait_for(revoked_grpc, 5)
    assert code == grpc.StatusCode.UNAUTHENTICATED and 0 < tokens < LONG, (code, details)
    assert "API key was revoked" in details and REVOKED not in details, details
    events = await asyncio.wait_for(revoked_sse, 5)
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["code"] == "invalid_api_key" and "API key was revoked" in error["message"]
    assert decode.cut == {"r-grpc", "r-sse"}  # cancelled on the worker: its blocks and slot freed there
    assert await asyncio.wait_for(kept, 10) == (grpc.StatusCode.OK, "", 150) and decode.done == {"k-grpc"}
    assert lifecycle.in_flight == 0 and not len(lifecycle.relay.keyed)


async def test_a_whole_answer_cut_is_a_401_and_a_key_revoked_while_its_body_is_read_is_refused(router) -> None:
    """A non-streaming answer cut mid-way is a 401 saying why, as a refused one is. The HTTP API checks the key
    before it reads the body: a key revoked while the body comes is refused before anything runs."""
    server, lifecycle, decode, keys, _ = router
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": LONG, "ignore_eos": True}).encode()
    headers = {"authorization": f"Bearer {REVOKED}", "content-type": "application/json"}
    half_sent = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield body[:10]
        half_sent.set()
        await asyncio.sleep(0.5)  # the reload comes meanwhile
        yield body[10:]

    async with httpx2.AsyncClient(base_url=f"http://{server.http.address}", timeout=30) as http:
        whole = asyncio.create_task(http.post("/v1/completions", content=body, headers=headers))
        while not decode.calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # some tokens in
        uploading = asyncio.create_task(http.post("/v1/completions", content=slow_body(), headers=headers))
        await asyncio.wait_for(half_sent.wait(), 5)
        key_file(keys, **{KEPT: "team-k"})
        server.key_reload.reload(lifecycle)
        cut, refused = await asyncio.wait_for(asyncio.gather(whole, uploading), 5)
    for answer in (cut, refused):
        assert answer.status_code == 401 and "API key was revoked" in answer.json()["error"]["message"], answer.text
    assert decode.calls == 1 and decode.cut and not decode.done  # the refused one never reached the worker


async def test_a_request_whose_key_is_revoked_while_it_waits_for_a_worker_is_never_sent_to_one(router) -> None:
    """Revoked before its decode call (waiting for a placement here; a move's wait is the same): ended before it."""
    server, lifecycle, decode, keys, registry = router
    (decode_worker,) = registry.workers(Role.DECODE)
    registry.remove(decode_worker.worker_id)
    waiting = asyncio.create_task(grpc_stream(server.address, REVOKED, "r-waits", 4, asyncio.Event()))
    while not lifecycle.in_flight:
        await asyncio.sleep(0.01)
    key_file(keys, **{KEPT: "team-k"})
    server.key_reload.reload(lifecycle)
    registry.publish(decode_worker)
    code, details, _ = await asyncio.wait_for(waiting, 10)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "API key was revoked" in details, details
    assert decode.calls == 0 and lifecycle.in_flight == 0


def test_a_key_is_revoked_when_removed_or_given_to_another_tenant_not_when_renamed_or_recapped() -> None:
    def table(*entries: tuple[str, str, str, int]) -> KeyTable:
        return KeyTable({digest(k): Tenant(t, name, max_concurrent=n) for k, t, name, n in entries})

    before = table(("k1", "a", "one", 1), ("k2", "a", "two", 1), ("k3", "b", "three", 1), ("k4", "b", "four", 1))
    streams = KeyedStreams()
    held = [streams.held(before.authenticate({"authorization": f"Bearer k{i}"}), before) for i in range(1, 5)]
    opened = [h.__enter__() for h in held]
    after = table(("k1", "a", "renamed", 5), ("k3", "c", "three", 1), ("k5", "b", "four", 1))  # k4's name, new key
    ended = streams.revoke(after)
    assert sorted(t.key_name for t in ended) == ["four", "three", "two"]
    assert [s.revoked for s in opened] == [False, True, True, True]
    assert streams.revoke(after) == []  # each stream ended once
    with pytest.raises(UnauthenticatedError):
        opened[1].check(7)
