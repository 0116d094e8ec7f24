"""End to end through `pdserve up` (Ray actors, real gRPC on loopback, real torch.distributed KV transfer)."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess, alive, descendants
from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
from pdserve.registry.base import DEFAULT_TTL_S
from pdserve.rpc.client import StreamResult, generate
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.integration.cluster_view import status_json
from tests.integration.worker_view import idle, workers

pytestmark = pytest.mark.timeout(300)
MODES = {
    "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"],
    "colocated": ["--mode", "colocated", "--workers", "2"],
}
# Requests whose id starts with this decode 50 ms a token more: one a test leaves must still be running when the
# test checks that the cluster freed it, not have finished on its own meanwhile.
SLOW = "slow-"
SLOW_STEPS = {"PDSERVE_FAULT_SLOW_STEP_S": "0.05", "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": SLOW}


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request, tmp_path_factory):
    log = tmp_path_factory.mktemp("cluster") / f"{request.param}.log"
    args = ("--model", "tiny-random", "--kv-cache-gb", "0.05", *MODES[request.param])
    proc = ClusterProcess(*args, log_path=log, env=SLOW_STEPS)
    proc.mode = request.param
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    """The single-process engine: what every cluster answer must equal for greedy requests."""
    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_threads=1))

    def run(prompt_ids: list[int], max_tokens: int, **kw: object) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]
        return engine.generate([prompt_ids], params)[0].token_ids

    return engine.tokenizer, run


def collect(address: str, request: pb.GenerateRequest, timeout_s: float = 60.0):
    async def go():
        result = None
        async for _, running in generate(address, request, timeout_s):
            result = running
        return result

    return asyncio.run(go())


def sampling(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def test_concurrent_requests_match_single_process_engine(cluster, reference):
    tokenizer, run = reference
    requests = [
        (pb.GenerateRequest(prompt="hello world", sampling=sampling(12)), tokenizer.encode("hello world")),
        (
            pb.GenerateRequest(prompt="The quick brown fox", sampling=sampling(20)),
            tokenizer.encode("The quick brown fox"),
        ),
        (pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9] * 7, sampling=sampling(16)), [5, 6, 7, 8, 9] * 7),
        (
            pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi!")], sampling=sampling(10)),
            tokenizer.apply_chat_template([("user", "hi!")]),
        ),
        (pb.GenerateRequest(prompt="x" * 300, sampling=sampling(8)), tokenizer.encode("x" * 300)),
    ] * 2

    async def all_at_once():
        async def one(req):
            result = None
            async for _, running in generate(cluster.address, req, 60):
                result = running
            return result

        return await asyncio.gather(*(one(r) for r, _ in requests))

    before = status_json(cluster.address)["admitted"]
    results = asyncio.run(all_at_once())
    after = status_json(cluster.address)["admitted"]  # what autoscale reads: admitted, and what finished generated
    asked = sum(r.sampling.max_tokens for r, _ in requests)
    gained = {k: after[k] - before[k] for k in after}
    assert gained == gained | {"requests": 10, "max_tokens": asked, "finished": 10, "completion_tokens": asked}
    for (req, prompt_ids), result in zip(requests, results, strict=True):
        want = run(prompt_ids, req.sampling.max_tokens)
        assert result.token_ids == want
        assert result.finish_reason == "length"
        assert 1 <= result.messages <= len(want)  # a token per message; a client behind the engine gets several
        assert result.usage.prompt_tokens == len(prompt_ids)
        assert result.usage.completion_tokens == len(want)
        assert result.usage.ttft_ms > 0


def test_seeded_requests_sample_what_the_single_process_engine_samples_alone(cluster, reference):
    """The first token drawn on the prefill worker, the rest on the decode worker, beside other requests: each
    seeded request's tokens are the engine's for that seed run alone (the noise is its seed's and positions')."""
    _, run = reference
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(100, 160))]
    seeded = [(p, seed) for seed in (3, 2**64 - 1) for p in prompts]
    requests = [
        pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(16, temperature=1.0, top_p=0.95, seed=seed))
        for p, seed in seeded
    ] + [pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(24)) for p in prompts]  # greedy neighbours

    async def all_at_once():
        return await asyncio.gather(*(asyncio.to_thread(collect, cluster.address, r) for r in requests))

    results = asyncio.run(all_at_once())
    drawn = [result.token_ids for result in results[: len(seeded)]]
    assert drawn == [run(p, 16, temperature=1.0, top_p=0.95, seed=seed) for p, seed in seeded]
    assert drawn[: len(prompts)] != drawn[len(prompts) :]  # the seed matters


def test_stop_token_finishes_with_stop(cluster, reference):
    _, run = reference
    prompt = [10, 20, 30, 40]
    free_run = run(prompt, 12)
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    result = collect(
        cluster.address, pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(12, stop_token_ids=[stop_at]))
    )
    assert result.finish_reason == "stop"
    assert result.token_ids == free_run[: first + 1]


def hi(params: pb.SamplingParams) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hi", sampling=params)


BAD_REQUESTS = {
    "nothing": (pb.GenerateRequest(), "prompt"),
    "empty prompt": (pb.GenerateRequest(prompt=""), "prompt"),
    "prompt and ids": (pb.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
    "ids outside vocab": (pb.GenerateRequest(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
    "beyond context": (hi(pb.SamplingParams(max_tokens=10**6)), "max_tokens"),
    "negative temperature": (
        hi(pb.SamplingParams(temperature=-1)),
        "temperature",
    ),
    "nan temperature": (
        hi(pb.SamplingParams(temperature=math.nan)),
        "temperature",
    ),
    "negative top_p": (hi(pb.SamplingParams(top_p=-0.5)), "top_p"),
    "nan top_p": (hi(pb.SamplingParams(top_p=math.nan)), "top_p"),
    "top_p above 1": (hi(pb.SamplingParams(top_p=1.5)), "top_p"),
    "negative top_k": (hi(pb.SamplingParams(top_k=-3)), "top_k"),
    "stop id outside vocab": (
        hi(pb.SamplingParams(stop_token_ids=[10**6])),
        "stop_token_ids",
    ),
    "unknown role": (pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]), "role"),
    "negative ttft slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(ttft_ms=-1)), "slo.ttft_ms"),
    "nan tpot slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(tpot_ms=math.nan)), "slo.tpot_ms"),
    "inf ttft slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(ttft_ms=math.inf)), "slo.ttft_ms"),
    "inf temperature": (hi(pb.SamplingParams(temperature=math.inf)), "sampling.temperature"),
    "request_id too long": (pb.GenerateRequest(request_id="r" * 257, prompt="hi"), "request_id"),
    "too many stop strings": (hi(pb.SamplingParams(stop=["s"] * 17)), "sampling.stop"),
    # Past the prompt's cap (16 bytes a context token), within the public port's message size (a larger message is
    # gRPC's own RESOURCE_EXHAUSTED, before any handler: tests/unit/router/test_public_message_size.py).
    "prompt too large": (pb.GenerateRequest(prompt="x" * (1 << 17)), "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_server_stays_up(cluster, case):
    request, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        collect(cluster.address, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    good = collect(cluster.address, pb.GenerateRequest(prompt="ok", sampling=sampling(3)))
    assert len(good.token_ids) == 3


def test_cancel_mid_stream_frees_blocks_everywhere(cluster):
    async def blocks_in_use() -> int:
        """Polled while the request streams: the router's view is as of each worker's last heartbeat."""
        for _ in range(50):
            if used := sum(w.kv_blocks_used for w in await workers(cluster.address)):
                return used
            await asyncio.sleep(0.1)
        return 0

    async def start_then_cancel():
        request = pb.GenerateRequest(request_id=f"{SLOW}cancel", prompt="cancel me " * 20, sampling=sampling(1000))
        async with channel(cluster.address) as ch:
            call = generate_pb2_grpc.GenerationStub(ch).Generate(request)
            seen = 0
            async for _ in call:
                seen += 1
                if seen == 5:
                    in_use = await blocks_in_use()
                    call.cancel()
                    return seen, in_use
        raise AssertionError("the stream ended before it could be cancelled")

    seen, in_use = asyncio.run(start_then_cancel())
    assert seen == 5 and in_use > 0  # the sequence held blocks while it streamed
    assert asyncio.run(_wait_until_idle(cluster.address))


def test_deadline_propagates_and_frees_blocks(cluster):
    # 1000 tokens of 50 ms: 50 s, five times the idle wait.
    request = pb.GenerateRequest(request_id=f"{SLOW}deadline", prompt="slow " * 10, sampling=sampling(1000))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        collect(cluster.address, request, timeout_s=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert asyncio.run(_wait_until_idle(cluster.address))


async def _wait_until_idle(router: str, timeout_s: float = 10.0) -> bool:
    """Every worker the router knows soon holds no block for a live sequence and runs nothing."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        found = await workers(router)
        if found and all(idle(w) for w in found):
            return True
        await asyncio.sleep(0.2)
    return False


def test_the_start_shows_no_warning_about_a_sigterm_handler_ray_did_not_set(cluster):
    """Ray starts off the main thread, so it sets no SIGTERM handler and says so; pdserve's own handler is the one
    in force (the test below), so the warning would only mislead an operator reading the start."""
    assert "ready" in cluster.log() and "SIGTERM handler is not set" not in cluster.log()


def test_sigterm_drains_with_every_worker_listed_then_stops_everything_within_60s(cluster):
    """The router's drain keeps its workers in placement (a retry, a move, a later choice needs them): they once
    dropped out of the embedded registry DEFAULT_TTL_S into it, its supervision already stopped. A stream that
    outlasts the drain's grace is cut with UNAVAILABLE saying so (it got gRPC's bare "Cancelling all calls")."""
    children = descendants(cluster.proc.pid)
    assert children, "Ray and the worker actors run as child processes"

    async def stream(request: pb.GenerateRequest, started: asyncio.Event) -> StreamResult | grpc.aio.AioRpcError:
        result = None
        try:
            async for _, result in generate(cluster.address, request, 90.0):  # noqa: B007 (the last is the answer)
                started.set()
        except grpc.aio.AioRpcError as e:
            return e
        return result

    async def stop_during_streams() -> tuple[set[str], set[str], list[StreamResult | grpc.aio.AioRpcError], float]:
        listed = {w.id for w in await workers(cluster.address)}
        # 200 tokens of 50 ms: 10 s, past the registry's TTL and within the router's 20 s drain; 800: 40 s, past it.
        requests = [
            pb.GenerateRequest(request_id=f"{SLOW}{n}", prompt="drain " * 10, sampling=sampling(n)) for n in (200, 800)
        ]
        started = [asyncio.Event() for _ in requests]
        streaming = [asyncio.create_task(stream(r, s)) for r, s in zip(requests, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
        stopping = asyncio.create_task(asyncio.to_thread(cluster.stop))
        await asyncio.sleep(DEFAULT_TTL_S + 1)
        during = {w.id for w in await workers(cluster.address)}
        return listed, during, await asyncio.gather(*streaming), await stopping

    listed, during, (finished, cut), took = asyncio.run(stop_during_streams())
    assert during == listed and len(listed) == 2
    assert isinstance(finished, StreamResult), finished
    assert finished.finish_reason == "length" and len(finished.token_ids) == 200
    assert isinstance(cut, grpc.aio.AioRpcError) and cut.code() == grpc.StatusCode.UNAVAILABLE, cut
    assert "drain's grace of 20 s ran out; retry on another replica" in (cut.details() or ""), cut.details()
    assert cluster.proc.returncode == 0, cluster.log()[-2000:]
    assert "drain grace of 20 s ran out; streams still open, cut with UNAVAILABLE: 1" in cluster.log()
    assert took < 60
    leftovers = [pid for pid in children if alive(pid)]
    assert not leftovers, leftovers
