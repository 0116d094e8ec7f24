"""A caller's gRPC deadline shorter than its request's predicted first token: the router answers
DEADLINE_EXCEEDED at once, saying so, and starts nothing (a review watched a 1500-token prompt with a 50 ms deadline
compute for 2.1 s after its caller had gone). The same request with time to spare is served. A real router on
loopback (tiny-random's tokenizer), its workers in an in-process registry, the decode worker a stand-in. Either way
the call's metadata carries the request's id (x-request-id), a refusal's in its trailers."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.rpc.errors import RETRY_PUSHBACK_KEY
from pdserve.rpc.metadata import REQUEST_ID_KEY
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.admission import DeadlineTooShortError
from services.router.generation import generate
from services.router.server import start_router
from services.router.ticket import Ticket
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
PROMPT = [5 + i % 200 for i in range(2000)]  # 2 s of prefill on the round profile: 1 ms a token


async def call(address: str, timeout_s: float, request_id: str = "") -> tuple[grpc.StatusCode, str, float, dict]:
    """The call's status, details, time and request ids: the initial metadata's, and the trailing metadata's."""
    request = pb.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=4), request_id=request_id
    )
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address) as ch:
        stream = generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout_s)
        code, details = grpc.StatusCode.OK, ""
        try:
            async for _ in stream:
                pass
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
        ids = {
            "initial": dict(await stream.initial_metadata() or ()).get(REQUEST_ID_KEY),
            "trailing": dict(await stream.trailing_metadata() or ()).get(REQUEST_ID_KEY),
        }
    return code, details, time.monotonic() - started, ids


async def test_a_deadline_shorter_than_the_predicted_first_token_is_answered_at_once(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    decode = StandInDecode()
    registry = InMemoryRegistry(ttl_s=600)
    telemetry = Telemetry("pdserve-router")
    async with serving(decode) as d0:
        registry.publish(worker("p0"))
        registry.publish(worker("d0", "decode", address=d0))
        server, _ = await start_router(
            "tiny-random", registry, InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0, telemetry
        )
        try:
            code, details, took, ids = await call(server.address, 1.0)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
            assert "predicted in" in details and "past the caller's deadline" in details, details  # the router's
            assert took < 0.9 and decode.calls == 0  # at once, and nothing started
            # No message to echo its id in, and the caller set none: the trailers carry the one the router gave it.
            assert ids["initial"] is None and len(ids["trailing"] or "") == 32, ids
            code, details, _, ids = await call(server.address, 30.0, "mine")
            assert code == grpc.StatusCode.OK and decode.calls == 1, details
            assert ids == {"initial": "mine", "trailing": "mine"}
            # An id no metadata value can carry (the proto allows any string): refused naming it, echoed nowhere.
            code, details, _, ids = await call(server.address, 30.0, "\x00\n\u202e")
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id:"), details
            assert ids == {"initial": None, "trailing": None}, ids
        finally:
            await server.stop(None)
    outcomes = requests_by_outcome(telemetry)
    expected = {("deadline_exceeded", "anonymous"): 1, ("finished", "anonymous"): 1, ("invalid", "anonymous"): 1}
    assert outcomes == expected, outcomes


async def refused_for_deadline(lifecycle, prompt_tokens: int, left_s: float) -> DeadlineTooShortError:
    request = pb.GenerateRequest(prompt_token_ids=PROMPT[:prompt_tokens], sampling=pb.SamplingParams(max_tokens=4))

    async def admitted(ticket: Ticket) -> None:
        raise AssertionError("admitted")

    with pytest.raises(DeadlineTooShortError) as err:
        async for _ in generate(lifecycle, request, {}, lambda: left_s, admitted):
            pass
    return err.value


async def test_a_deadline_the_queue_alone_rules_out_counts_as_demand_turned_away_and_one_its_own_cost_does_not():
    """What the planner's autoscaler reads as load the cluster could not take: a prompt whose own 100 ms fits a
    0.3 s deadline but not behind 500 ms queued is such demand; a 2000-token prompt (2 s) never fits it."""
    busy = Router([worker("p0", queued_prefill_tokens=500), worker("d0", "decode")])
    lifecycle = busy.lifecycle()
    assert (await refused_for_deadline(lifecycle, 100, 0.3)).by_load
    assert lifecycle.admitted.shed == 1 and lifecycle.admitted.shed_prompt_tokens == 100
    assert "ms of it queued" in str(await refused_for_deadline(lifecycle, 100, 0.3))
    idle = Router([worker("p0"), worker("d0", "decode")]).lifecycle()
    assert not (await refused_for_deadline(idle, 2000, 0.3)).by_load
    assert idle.admitted.shed == 0  # the request's own cost: no worker added would serve it


async def test_a_shed_calls_trailers_carry_its_retry_hint_and_its_id(monkeypatch):
    """The error mapping's retry hint is added beside the request's id, not in its place."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    registry = InMemoryRegistry(ttl_s=600)
    registry.publish(worker("p0", queued_prefill_tokens=30_000))  # 30 s queued: past the default TTFT SLO
    registry.publish(worker("d0", "decode"))
    server, _ = await start_router("tiny-random", registry, InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0)
    try:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT[:10], request_id="shed-me")
        async with grpc.aio.insecure_channel(server.address) as ch:
            stream = generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
    finally:
        await server.stop(None)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    trailers = dict(err.value.trailing_metadata() or ())
    assert trailers[REQUEST_ID_KEY] == "shed-me" and int(trailers[RETRY_PUSHBACK_KEY]) >= 100, trailers
