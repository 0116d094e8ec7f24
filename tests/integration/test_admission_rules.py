"""The four admission rules through a real `pdserve up` (tiny-random, disaggregated 1 + 1).

The cluster runs with a 1 ms default TTFT, below any prompt's own cost, and a KV cache smaller than the
model's context, so each rule can be reached with ordinary requests.
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.integration.cluster_view import status_json

pytestmark = pytest.mark.timeout(300)
DEFAULT_TTFT_MS = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("admission") / "cluster.log"
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.0018"]
    # No idle speed re-check: its readings replace the speed factor, and on tiny-random they vary 1.5-2.6x, so a
    # probe between two predictions compared here moved one of them by as much (a cached prompt predicted 25 ms
    # against 49 uncached, where the cache alone makes it under half).
    args += ["--speed-recheck-s", "0"]
    proc = ClusterProcess(*args, "--default-ttft-ms", str(DEFAULT_TTFT_MS), log_path=log)
    yield proc
    proc.stop()


def wait_idle(address: str, timeout_s: float = 15.0) -> dict:
    """Until the router's view shows no work anywhere (heartbeats included) and no KV block held."""
    end = time.monotonic() + timeout_s
    while True:
        s = status_json(address)
        busy = [
            w for w in s["workers"] if w["running"] or w["waiting"] or w["queued_prefill_tokens"] or w["kv_blocks_used"]
        ]
        if (not busy and not s["in_flight"]) or time.monotonic() > end:
            assert not busy and not s["in_flight"], s
            return s
        time.sleep(0.3)


def send(address: str, requests: list[pb.GenerateRequest]) -> list[tuple[str, dict, object]]:
    """All at once; per request (status name, initial and trailing metadata, tokens or the error)."""

    async def one(stub, request):
        call = stub.Generate(request, timeout=60)
        try:
            tokens = [t async for msg in call for t in msg.token_ids]
        except grpc.aio.AioRpcError as e:
            return e.code().name, dict(e.trailing_metadata() or ()), e
        return "OK", dict(await call.initial_metadata()), tokens

    async def all_():
        async with channel(address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(one(stub, r) for r in requests))

    return asyncio.run(all_())


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 250 for i in range(n)]


def request(n: int, seed: int = 0, max_tokens: int = 4, ttft_ms: float = 0.0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt(n, seed),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo=pb.SLO(ttft_ms=ttft_ms),
    )


def test_no_slo_request_costlier_than_the_default_ttft_is_served_on_an_idle_cluster(cluster):
    wait_idle(cluster.address)
    ((code, meta, tokens),) = send(cluster.address, [request(1000)])
    assert code == "OK", tokens
    assert len(tokens) == 4
    assert float(meta[PREDICTED_TTFT_KEY]) > DEFAULT_TTFT_MS  # its own cost alone exceeds the default


def test_explicit_slo_below_the_idle_cost_is_invalid_naming_the_offer(cluster):
    wait_idle(cluster.address)
    ((code, _, err),) = send(cluster.address, [request(1000, seed=1, ttft_ms=0.01)])
    assert code == "INVALID_ARGUMENT", err
    details = err.details()
    assert "slo.ttft_ms" in details
    offered = int(re.search(r"smallest this cluster can offer is (\d+) ms", details).group(1))
    assert offered >= 1
    assert retry_after_ms(err.trailing_metadata()) is None  # no retry can help
    # The offer is the profile's idle speed; live contention (a busy CI host) can make the same prompt costlier
    # for now. Above the offer the answer is never INVALID_ARGUMENT: served, or shed with a retry hint naming the
    # live own cost, and a little above that is served.
    slo_ms = offered * 1.5 + 5
    for _ in range(3):
        wait_idle(cluster.address)
        ((code, meta, result),) = send(cluster.address, [request(1000, seed=2, ttft_ms=slo_ms)])
        if code == "OK":
            break
        assert code == "RESOURCE_EXHAUSTED", result
        assert int(meta["grpc-retry-pushback-ms"]) > 0
        own_ms = float(re.search(r"this prompt.s own (\d+) ms", result.details()).group(1))
        assert own_ms > offered  # only a slower live speed sheds what the offer allows
        slo_ms = own_ms * 1.5 + 5
    assert code == "OK", result


def test_queueing_sheds_with_a_retry_hint_and_serves_the_rest(cluster):
    wait_idle(cluster.address)
    results = send(cluster.address, [request(300, seed=10 + i) for i in range(24)])
    codes = [code for code, _, _ in results]
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert "OK" in codes  # the first finds the queue empty
    shed = [(meta, err) for code, meta, err in results if code == "RESOURCE_EXHAUSTED"]
    assert shed, "24 simultaneous no-SLO requests over a 1 ms default: all but the first queue"
    assert any("TTFT" in err.details() and "queued" in err.details() for _, err in shed), [e.details() for _, e in shed]
    assert all(int(meta["grpc-retry-pushback-ms"]) >= 100 for meta, _ in shed)


def test_more_kv_blocks_than_any_worker_holds_is_invalid(cluster):
    s = wait_idle(cluster.address)
    total = max(w["kv_blocks_total"] for w in s["workers"] if w["role"] == "decode")
    assert (total + 1) * 16 <= 4096, total  # reachable inside tiny-random's context
    too_many = (total + 1) * 16 - 16
    ((code, meta, err),) = send(cluster.address, [request(16, seed=3, max_tokens=too_many)])
    assert code == "INVALID_ARGUMENT", err
    assert "sampling.max_tokens" in err.details() and f"{total} in total" in err.details()
    assert "grpc-retry-pushback-ms" not in meta
    ((code, _, tokens),) = send(cluster.address, [request(16, seed=3, max_tokens=total * 16 - 32)])
    assert code == "OK", tokens  # what fits in the total is served
    ((code, _, err),) = send(cluster.address, [request((total + 1) * 16, seed=3, max_tokens=1)])
    assert code == "INVALID_ARGUMENT" and err.details().startswith("prompt: the prompt"), err  # not max_tokens'


def test_a_prompt_its_prefill_worker_evicted_is_predicted_uncached_again(cluster):
    """The router learns of evictions from the worker's prefix-cache journal: a prompt is predicted cached while
    its blocks are there, and uncached once a prompt as large as the whole cache has evicted them. Each TTFT the
    router relays moves its calibration factor, so each prediction is held against one made a request before
    it: a prompt of the same length seen for the first time."""

    def predicted_ttft_ms(n: int, seed: int) -> float:
        wait_idle(cluster.address)
        time.sleep(3.0)  # a few supervisor checks (every 0.5 s): the prefill worker's journal reaches the index
        ((code, meta, tokens),) = send(cluster.address, [request(n, seed=seed, max_tokens=1)])
        assert code == "OK", tokens
        return float(meta[PREDICTED_TTFT_KEY])

    total = min(w["kv_blocks_total"] for w in wait_idle(cluster.address)["workers"])
    cold = predicted_ttft_ms(1000, seed=20)
    warm = predicted_ttft_ms(1000, seed=20)
    predicted_ttft_ms(total * 16 - 1, seed=21)  # every block of the prefill worker: the first prompt's go
    fresh = predicted_ttft_ms(1000, seed=22)
    after = predicted_ttft_ms(1000, seed=20)
    print(f"predicted TTFT: cold {cold} ms, cached {warm} ms; after the eviction {after} ms, a new prompt {fresh} ms")
    assert warm < 0.5 * cold, (cold, warm)
    assert after > 0.3 * fresh, (cold, warm, fresh, after)  # cached, it would be near 0.1
