"""A burst far beyond capacity on the real model: some requests admitted, the rest shed at once.

"At once" is judged against a baseline measured in the same burst, not a wall-clock figure (this machine is
shared and noisy): a rejection that waited behind the queued prefills would take at least as long as the first
admitted request's TTFT. The absolute p99 (goal: under 200 ms) is what `pdserve bench admission` prints."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.client import generate
from pdserve.v1 import generate_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.latency, pytest.mark.timeout(600)]
BURST, PROMPT_TOKENS, TTFT_SLO_MS = 100, 256, 3000.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("burst") / "cluster.log"
    proc = ClusterProcess(
        "--model", "smollm2-135m", "--mode", "disaggregated", "--prefill", "1", "--decode", "1", log_path=log
    )
    yield proc
    proc.stop()


def warm_up(address: str) -> None:
    """A few prompts of the burst's size one at a time: the router's predictions learn this machine's speed
    from the TTFTs it relays (a profile measured while every worker starts at once runs slow)."""

    async def one(seed: int) -> None:
        prompt = [100 + (seed * 7919 + i * 31) % 48000 for i in range(PROMPT_TOKENS)]
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2))
        async for _ in generate(address, request, 120):
            pass

    for seed in range(4):
        asyncio.run(one(seed))


def test_burst_admits_what_fits_and_sheds_the_rest_fast(cluster):
    warm_up(cluster.address)
    cmd = [sys.executable, "-m", "tests.integration.burst_client", cluster.address, str(BURST), str(PROMPT_TOKENS)]
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([*cmd, str(TTFT_SLO_MS)], cwd=root, capture_output=True, text=True, timeout=300, check=True)
    results = json.loads(out.stdout)
    admitted = [r["seconds"] for r in results if r["status"] == "ok"]
    shed = [(r["seconds"], r["meta"]) for r in results if r["status"] == "RESOURCE_EXHAUSTED"]
    others = [r["status"] for r in results if r["status"] not in ("ok", "RESOURCE_EXHAUSTED")]
    assert not others, others
    assert admitted and shed, f"admitted {len(admitted)}, shed {len(shed)}"
    slowest_rejection, fastest_admitted = max(t for t, _ in shed), min(admitted)
    print(
        f"admitted {len(admitted)}, shed {len(shed)}, TTFTs {sorted(round(t, 2) for t in admitted)}, "
        f"slowest rejection {slowest_rejection * 1e3:.0f} ms ({slowest_rejection / fastest_admitted:.2f} of the "
        "fastest admitted TTFT)"
    )
    assert slowest_rejection < fastest_admitted / 4
    assert all(int(meta["grpc-retry-pushback-ms"]) >= 100 for _, meta in shed)
    met = sum(t <= TTFT_SLO_MS / 1e3 for t in admitted)
    assert met >= 0.95 * len(admitted), sorted(admitted)
