"""Traces, metrics and `pdserve status` of a real `pdserve up` (Ray actors, real gRPC, real KV transfer).

The workers run in other processes, so their in-memory exporters cannot be read from here: the cluster
exports with the SDK's own OTLP/gRPC exporter (configured only by OTEL_* variables, as in production) to a
small OTLP trace receiver running in this test process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from pdserve.build import current_build
from pdserve.cluster.local_process import ClusterProcess, free_port
from pdserve.rpc.client import generate
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.integration.cluster_view import scrape, status_json, total

pytestmark = pytest.mark.timeout(180)
SERVICES = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
OUTCOMES = ("finished", "cancelled", "deadline_exceeded", "failed")


@pytest.fixture(scope="module")
def cluster(collector, tmp_path_factory):
    log = tmp_path_factory.mktemp("observability") / "cluster.log"
    metrics_port = free_port()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1"]
    proc = ClusterProcess(*args, "--metrics-port", str(metrics_port), log_path=log, env=env)
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield proc
    proc.stop()


def run(address: str, request: pb.GenerateRequest, n: int = 1) -> list:
    async def one():
        result = None
        async for _, running in generate(address, request, 60):
            result = running
        return result

    async def all_():
        return await asyncio.gather(*(one() for _ in range(n)))

    return asyncio.run(all_())


def test_one_request_is_one_trace_across_all_three_services(cluster, collector):
    request_id = uuid.uuid4().hex
    request = pb.GenerateRequest(
        request_id=request_id, prompt="trace me " * 5, sampling=pb.SamplingParams(max_tokens=6)
    )
    (result,) = run(cluster.address, request)
    assert len(result.token_ids) >= 1
    want = {
        "admission",
        "placement",
        "prefill.queue_wait",
        "prefill.compute",
        "kv_transfer.send",
        "kv_transfer.recv",
        "decode.queue_wait",
        "decode.stream",
    }
    deadline = time.monotonic() + 20
    while True:
        trace_id = collector.trace_of(request_id)
        spans = collector.trace(trace_id) if trace_id else []
        names = {s.name for _, s in spans}
        # The root (the router's server span) ends last, with the stream: under load it is exported after the rest.
        rooted = any(not s.parent_span_id for _, s in spans)
        if (want <= names and {svc for svc, _ in spans} == SERVICES and rooted) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert trace_id is not None, "no router span carried the request id"
    assert {svc for svc, _ in spans} == SERVICES, sorted(names)
    assert want <= names, sorted(want - names)
    ids = {s.span_id for _, s in spans}
    roots = [s for _, s in spans if not s.parent_span_id]
    assert len(roots) == 1 and roots[0].name.endswith("Generation/Generate"), [s.name for s in roots]
    orphans = [s.name for _, s in spans if s.parent_span_id and s.parent_span_id not in ids]
    assert not orphans, orphans  # every parent link resolves inside the one trace, across both gRPC hops
    by_name = {s.name: (svc, s) for svc, s in spans}
    stream_svc, stream = by_name["decode.stream"]
    assert stream_svc == "pdserve-decode"
    attrs = {a.key: a.value for a in stream.attributes}
    assert attrs["completion_tokens"].int_value == len(result.token_ids) and attrs["worker.id"].string_value
    # Every hop is keyed by the router's own id, which the router's spans carry beside the client's.
    keys = {a.value.string_value for svc, s in spans for a in s.attributes if a.key == "request.id"}
    assert len(keys) == 1 and request_id not in keys, keys
    # The router's log line for the request leads to that trace (its server span's ids).
    router_span_ids = {s.span_id.hex() for svc, s in spans if svc == "pdserve-router"}
    ended = [line for line in logged_lines(cluster) if line.get("request_id") == request_id and "outcome" in line]
    assert [(line["outcome"], line.get("trace_id")) for line in ended] == [("finished", trace_id.hex())], ended
    assert ended[0]["span_id"] in router_span_ids


def logged_lines(cluster: ClusterProcess) -> list[dict]:
    """The cluster's JSON log lines (its log also holds lines of other shapes: Ray's, the launcher's banner)."""
    lines = []
    for text in cluster.log().splitlines():
        try:
            line = json.loads(text[text.find("{") :])
        except ValueError:
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines


def test_a_stream_the_caller_cancels_is_marked_cancelled_not_failed(cluster, collector):
    request_id = uuid.uuid4().hex
    sampling = pb.SamplingParams(max_tokens=400, ignore_eos=True)
    request = pb.GenerateRequest(request_id=request_id, prompt="cancel me", sampling=sampling)

    async def cancel_after_three() -> None:
        async with channel(cluster.address) as ch:
            call = generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60)
            for _ in range(3):
                await call.read()
            call.cancel()

    asyncio.run(cancel_after_three())
    deadline = time.monotonic() + 20
    stream = None
    while stream is None and time.monotonic() < deadline:
        spans = collector.trace(trace_id) if (trace_id := collector.trace_of(request_id)) else []
        stream = next((s for _, s in spans if s.name == "decode.stream"), None)
        time.sleep(0.2)
    assert stream is not None, "no decode.stream span for the cancelled request"
    attrs = {a.key: a.value for a in stream.attributes}
    assert attrs["cancelled"].bool_value and 3 <= attrs["completion_tokens"].int_value < 400, attrs
    assert stream.status.code != stream.status.STATUS_CODE_ERROR


def test_a_request_its_callers_deadline_ends_counts_once_as_deadline_exceeded(cluster, collector):
    """Not `cancelled` (a caller that gave up) nor `failed` (the cluster's): its own outcome, counted once, and
    marked on the router's span. The stream is far longer than the deadline: it passes mid-stream."""
    request_id = uuid.uuid4().hex
    sampling = pb.SamplingParams(max_tokens=3000, ignore_eos=True)
    request = pb.GenerateRequest(request_id=request_id, prompt="too long for my deadline", sampling=sampling)
    before = scrape(cluster.metrics_url)

    async def call_with_deadline() -> None:
        async with channel(cluster.address) as ch:
            async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=0.5):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call_with_deadline())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value

    def counted(samples: dict) -> dict[str, float]:
        name = "pdserve_requests_total"
        return {o: total(samples, name, outcome=o) - total(before, name, outcome=o) for o in OUTCOMES}

    deadline = time.monotonic() + 20
    while (got := counted(scrape(cluster.metrics_url)))["deadline_exceeded"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # a second count, were there one, would come with the first
    assert counted(scrape(cluster.metrics_url)) == {**dict.fromkeys(OUTCOMES, 0.0), "deadline_exceeded": 1.0}, got
    marked = None
    while marked is None and time.monotonic() < deadline:
        spans = collector.trace(trace_id) if (trace_id := collector.trace_of(request_id)) else []
        marked = next((s for svc, s in spans for a in s.attributes if a.key == "deadline_exceeded"), None)
        time.sleep(0.2)
    assert marked is not None, "no router span marked deadline_exceeded"


def test_metrics_count_requests_and_blocks_return_to_zero(cluster):
    n = 5
    workers = status_json(cluster.address)["workers"]
    urls = {w["id"]: f"http://{w['metrics_address']}/metrics" for w in workers}
    before = scrape(cluster.metrics_url)
    before_workers = {w: scrape(u) for w, u in urls.items()}
    results = run(cluster.address, pb.GenerateRequest(prompt="count me", sampling=pb.SamplingParams(max_tokens=8)), n)
    assert all(r.token_ids for r in results)
    after = scrape(cluster.metrics_url)
    name = "pdserve_time_to_first_token_seconds_count"  # by tenant: the open cluster's is `anonymous`
    assert total(after, name, tenant="anonymous") - total(before, name, tenant="anonymous") == n
    finished = "pdserve_requests_total"
    assert total(after, finished, outcome="finished") - total(before, finished, outcome="finished") == n
    assert total(after, "pdserve_e2e_request_latency_seconds_count") >= n
    itl = "pdserve_inter_token_latency_seconds_count"  # one gap per token after the first, however they were sent
    assert total(after, itl) - total(before, itl) == sum(len(r.token_ids) - 1 for r in results)

    assert {w["role"] for w in workers} == {"prefill", "decode"}
    # Each request's queue time once on each worker that ran it (a decode worker: those its first token did not
    # end), its prefill time once on the prefill worker; observed on the engine thread before its tokens came.
    decoded = sum(len(r.token_ids) > 1 for r in results)
    timed = {"prefill": (n, n), "decode": (decoded, 0)}
    for worker in workers:
        w = worker["id"]
        samples, was = scrape(urls[w]), before_workers[w]
        counts = [
            total(samples, name, worker_id=w) - total(was, name, worker_id=w)
            for name in ("pdserve_request_queue_time_seconds_count", "pdserve_request_prefill_time_seconds_count")
        ]
        assert tuple(counts) == timed[worker["role"]], (w, counts)
    deadline = time.monotonic() + 15
    while True:
        used = {w: total(scrape(u), "pdserve_kv_blocks_used") for w, u in urls.items()}
        if not any(used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(used.values()), used
    for w in workers:  # what a dashboard counts by build through a rollout, and the status the same
        assert w["build"] == current_build()
        assert total(scrape(urls[w["id"]]), "pdserve_build_info", build=w["build"], worker_id=w["id"]) == 1
    for w, u in urls.items():  # every worker's engine steps, timed and counted by their batch's tokens
        samples = scrape(u)
        steps = total(samples, "pdserve_engine_step_tokens_count", worker_id=w)
        assert total(samples, "pdserve_engine_step_seconds_count", worker_id=w) == steps > 0, w
        assert total(samples, "pdserve_engine_step_tokens_sum", worker_id=w) >= steps, w
        assert total(samples, "pdserve_worker_speed_factor", worker_id=w) > 0, w  # what the router prices it by
    prefill = next(u for w, u in urls.items() if w.startswith("prefill"))
    samples = scrape(prefill)
    assert total(samples, "pdserve_kv_transfer_bytes_total") > 0
    assert total(samples, "pdserve_kv_transfer_seconds_count") > 0
    assert total(samples, "pdserve_kv_blocks_total") > 0


def test_status_lists_workers_with_block_counts(cluster):
    run(cluster.address, pb.GenerateRequest(prompt="status", sampling=pb.SamplingParams(max_tokens=4)))
    workers = status_json(cluster.address)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    for w in workers:
        assert {
            "id",
            "role",
            "address",
            "kv_blocks_used",
            "kv_blocks_cached",
            "kv_blocks_total",
            "running",
            "waiting",
        } <= set(w)
        assert w["kv_blocks_total"] > 0 and 0 <= w["kv_blocks_used"] <= w["kv_blocks_total"]
        assert w["health"] == "SERVING" and w["speed_factor"] > 0  # the live correction its heartbeat published
    table = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--addr", cluster.address],
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert table.returncode == 0 and "prefill-0" in table.stdout and "decode-1" in table.stdout, table.stdout
