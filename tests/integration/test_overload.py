"""Overload through a real `pdserve up` (1 + 1, tiny-random, a decode batch of 4): a crowd shed at once is told to
come back apart, later the larger it is, over gRPC (grpc-retry-pushback-ms) and the HTTP API (retry-after-ms and
Retry-After), and a retry once the room freed is served; a request whose caller cancelled, hung up or let its deadline
pass while it waited behind another prompt for the prefill worker is never prefilled. No timing is asserted: the
engine steps of `hold-` requests are slowed (PDSERVE_FAULT_SLOW_STEP_*) so that the states tested last, and each test
waits for the state it tests before it acts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import httpx2
import pytest

from pdserve.cluster.local_process import ClusterProcess, free_port
from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, generate_pb2_grpc
from pdserve.v1 import generate_pb2 as pb
from services.router.retry_pacing import MAX_SLOT_S, WINDOW_S
from tests.integration.cluster_view import scrape, total
from tests.integration.reference import greedy_request
from tests.integration.worker_view import by_role, idle

pytestmark = pytest.mark.timeout(300)
HOLD, HOLD_STEP_S = "hold-", 1.0  # each engine step running a `hold-` request takes 1 s longer
BATCH = 4  # the decode worker's max_num_seqs
CHUNK = 512  # tokens of a prompt one prefill step runs (EngineConfig's long_prefill_chunk)
BEHIND = CHUNK + 64  # a prompt that waits behind a hold- one: past one step, it does not go ahead of its chunks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overload")
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--max-num-seqs", str(BATCH)]
    args += ["--http-port", str(http_port := free_port())]
    env = {"PDSERVE_FAULT_SLOW_STEP_S": str(HOLD_STEP_S), "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": HOLD}
    proc = ClusterProcess(*args, log_path=folder / "cluster.log", env=env)
    proc.base_url = f"http://127.0.0.1:{http_port}/v1"
    yield proc
    proc.stop()


def prompt(seed: int, tokens: int = 16) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 250 for i in range(tokens)]


async def first_token(stub: generate_pb2_grpc.GenerationStub, request: pb.GenerateRequest) -> grpc.aio.Call:
    """The call once its first token came (its stream left open, holding its place in the decode batch)."""
    call = stub.Generate(request, timeout=120)
    while not (await call.read()).token_ids:
        pass
    return call


async def shed_hint_ms(stub: generate_pb2_grpc.GenerationStub, request: pb.GenerateRequest) -> int:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(request, timeout=60):
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    hint = retry_after_ms(info.value.trailing_metadata())
    assert hint is not None
    return hint


async def http_shed_hint_ms(base_url: str, seed: int) -> int:
    body = {"model": "tiny-random", "prompt": prompt(seed), "max_tokens": 4}
    async with httpx2.AsyncClient(base_url=base_url, timeout=60) as http:
        answer = await http.post("/completions", json=body)
    assert answer.status_code == 429, answer.text
    ms = int(answer.headers["retry-after-ms"])
    assert int(answer.headers["retry-after"]) == -(-ms // 1000)  # whole seconds, never sooner
    return ms


def test_requests_that_left_while_waiting_for_the_prefill_worker_are_never_prefilled(cluster):
    """A `hold-` prompt of 7 chunks holds the prefill worker for 7 slowed steps (at least 7 s); three requests admitted
    behind it wait there: one its gRPC caller cancels, one whose 3 s deadline passes, one whose HTTP caller hangs up.
    Each ends as its caller left, and the prefill worker runs only the `hold-` prompt: its prefill count grows by
    one."""

    async def run() -> tuple[float, dict[str, str]]:
        prefill_metrics = f"http://{(await by_role(cluster.address))['prefill'].metrics_address}/metrics"
        prefilled = total(scrape(prefill_metrics), "pdserve_request_prefill_time_seconds_count")
        async with channel(cluster.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            held = stub.Generate(greedy_request(f"{HOLD}prefill", prompt(7, 7 * CHUNK), 1), timeout=120)
            held_tokens = asyncio.ensure_future(tokens_of(held))
            await until(cluster.address, lambda w: w["prefill"].running == 1)
            # An SLO past what the hold- prompt's slowed steps may make the router predict: admitted, not shed.
            cancelled = stub.Generate(waiting_request("cancelled", prompt(8, BEHIND)), timeout=120)
            deadline = stub.Generate(waiting_request("deadline", prompt(9, BEHIND)), timeout=3.0)
            admitted = [PREDICTED_TTFT_KEY in dict(await c.initial_metadata()) for c in (cancelled, deadline)]
            if not all(admitted):  # both admitted, not refused at once
                pytest.fail(f"refused at once: {[await c.details() for c in (cancelled, deadline)]}")
            hung_up = asyncio.ensure_future(http_completion(cluster.base_url, prompt(10, BEHIND)))
            # Queued behind the hold- prompt (the one with a deadline too, unless that passed already).
            await until(cluster.address, lambda w: w["prefill"].waiting >= 2)
            cancelled.cancel()
            hung_up.cancel()
            outcomes = {"cancelled": await code_of(cancelled), "deadline": await code_of(deadline)}
            assert await held_tokens == 1
            await until(cluster.address, lambda w: idle(w["prefill"]) and idle(w["decode"]))
            return total(scrape(prefill_metrics), "pdserve_request_prefill_time_seconds_count") - prefilled, outcomes

    prefills, outcomes = asyncio.run(run())
    assert outcomes == {"cancelled": "CANCELLED", "deadline": "DEADLINE_EXCEEDED"}
    assert prefills == 1  # the hold- prompt's alone


def test_a_crowd_shed_at_once_is_told_to_come_back_apart_and_a_retry_once_there_is_room_is_served(cluster):
    """The decode batch held full by BATCH streams, 12 gRPC and 4 HTTP requests come at once: every one is shed with a
    hint of its own, each a slot (the router's admissions of the last WINDOW_S spread over it) after the one before,
    not the same hint for all (they came back together and were shed together again). Once the batch frees, one of
    them retried is served: the hint's promise."""

    async def run() -> tuple[list[int], int]:
        async with channel(cluster.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            holders = [
                await first_token(stub, greedy_request(f"{HOLD}batch-{i}", prompt(i), 500)) for i in range(BATCH)
            ]
            crowd = [
                pb.GenerateRequest(prompt_token_ids=prompt(100 + i), sampling=pb.SamplingParams(max_tokens=4))
                for i in range(12)
            ]
            hints = await asyncio.gather(
                *(shed_hint_ms(stub, r) for r in crowd), *(http_shed_hint_ms(cluster.base_url, i) for i in range(4))
            )
            for call in holders:
                call.cancel()
            while not idle((await by_role(cluster.address))["decode"]):
                await asyncio.sleep(0.2)
            served = [m async for m in stub.Generate(crowd[0], timeout=60)]
            return list(hints), sum(len(m.token_ids) for m in served)

    hints, tokens = asyncio.run(run())
    hints.sort()
    admitted = BATCH + 8  # at most, in the last WINDOW_S: the holders, and earlier tests' requests
    slot_ms = min(MAX_SLOT_S, WINDOW_S / admitted) * 1e3
    assert len(set(hints)) == len(hints), hints
    assert hints[-1] - hints[0] >= (len(hints) - 2) * slot_ms, hints  # the k-th within the k-th slot
    assert tokens == 4


def waiting_request(request_id: str, tokens: list[int]) -> pb.GenerateRequest:
    request = greedy_request(request_id, tokens, 4)
    request.slo.ttft_ms = 30_000
    return request


async def tokens_of(call: grpc.aio.UnaryStreamCall) -> int:
    return sum([len(m.token_ids) async for m in call])


async def code_of(call: grpc.aio.UnaryStreamCall) -> str:
    """How the call ended, as its caller saw it."""
    try:
        await tokens_of(call)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    except asyncio.CancelledError:
        return "CANCELLED"
    return "OK"


async def http_completion(base_url: str, tokens: list[int]) -> None:
    """A streamed completion over the HTTP API, read to its end (its caller hangs up when cancelled)."""
    body = {"model": "tiny-random", "prompt": tokens, "max_tokens": 4, "stream": True, "slo": {"ttft_ms": 30_000}}
    async with (
        httpx2.AsyncClient(base_url=base_url, timeout=120) as http,
        http.stream("POST", "/completions", json=body) as answer,
    ):
        async for _ in answer.aiter_lines():
            pass


async def until(router: str, state: Callable[[dict[str, admin_pb2.WorkerStatus]], bool]) -> None:
    """Waits for the workers (the router's view: role -> status, as of their last heartbeat) to reach `state`."""
    end = time.monotonic() + 60
    while not state(await by_role(router)):
        assert time.monotonic() < end, "the cluster never reached the state the test waits for"
        await asyncio.sleep(0.1)
