"""A decode worker's batch cap (`--max-num-seqs`) end to end, through `pdserve up`: with every place in the only
decode worker's batch held by a stream, the router sheds a new request with RESOURCE_EXHAUSTED and a retry hint
before anything reaches a worker, and serves it once a stream ends. And the worker's own refusal, asked directly
(what a router whose count is behind meets): RESOURCE_EXHAUSTED before any prefill runs."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.cluster_view import status_json
from tests.integration.in_process_workers import in_process_workers

pytestmark = pytest.mark.timeout(300)
CAP = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("batch_cap") / "cluster.log"
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.05"]
    proc = ClusterProcess(*args, "--max-num-seqs", str(CAP), log_path=log)
    yield proc
    proc.stop()


def request(max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=sampling)


async def tokens(stub: generate_pb2_grpc.GenerationStub, max_tokens: int) -> int:
    return sum([len(msg.token_ids) async for msg in stub.Generate(request(max_tokens), timeout=30)])


async def test_a_request_no_batch_has_a_place_for_is_shed_with_a_hint_and_served_once_one_frees(cluster):
    async with channel(cluster.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        assert await tokens(stub, 4) == 4  # warm: channels and the KV rendezvous made
        held = [stub.Generate(request(4000)) for _ in range(CAP)]
        for call in held:
            assert (await call.read()).token_ids  # streaming: each holds a place in the batch
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokens(stub, 4)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert f"no decode worker has room in its batch now (max_num_seqs {CAP})" in (err.value.details() or "")
        trailers = dict(err.value.trailing_metadata() or ())
        assert int(trailers["grpc-retry-pushback-ms"]) > 0
        held[0].cancel()
        end = time.monotonic() + 10
        while True:  # the router counts the place free once the cancelled stream's call has ended
            try:
                assert await tokens(stub, 4) == 4
                break
            except grpc.aio.AioRpcError as e:
                shown = (e, status_json(cluster.address)["workers"])
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < end, shown
                await asyncio.sleep(0.1)
        held[1].cancel()


def test_a_decode_worker_with_a_full_batch_refuses_a_hand_off_before_any_prefill():
    """In-process workers (max_num_seqs 1), called as a router calls them: a hand-off past the batch's one place
    is refused saying why; once the sequence in it ends, a hand-off is taken again."""
    engine = EngineConfig(
        model="tiny-random", num_threads=1, kv_cache_memory_gb=0.05, scheduler=SchedulerConfig(max_num_seqs=1)
    )
    with in_process_workers("cap", engine=engine) as (prefill, decode):
        asyncio.run(refused_while_full(decode.address(60), prefill.address(60)))


async def refused_while_full(decode_address: str, prefill_address: str) -> None:
    def handed_off(request_id: str, max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
        sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return worker_pb2.WorkerGenerateRequest(
            request_id=request_id, prompt_token_ids=[5, 6, 7, 8], sampling=sampling, prefill_address=prefill_address
        )

    async with channel(decode_address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        long = stub.Generate(handed_off("long", 4000), timeout=60)
        assert (await long.read()).token_ids  # its first token is out: it holds the batch's only place
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(handed_off("refused", 4), timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "batch is full (1 sequences, max_num_seqs 1)" in (err.value.details() or "")
        long.cancel()
        end = time.monotonic() + 10
        while True:  # the cancelled stream's abort reaches the engine between its steps
            try:
                tokens = [t async for r in stub.Generate(handed_off("after", 4), timeout=30) for t in r.token_ids]
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < end, e
                await asyncio.sleep(0.1)
        assert len(tokens) == 4
