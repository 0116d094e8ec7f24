"""A cluster on an IPv6 host, as the chart's `bindAddress: "::"` runs one: every listener binds `::`, the workers
advertise `::1` (an IPv6 POD_IP, which addresses write in brackets), and
- requests reach the router over IPv6 and over IPv4 (dual-stack), the router dials the workers, the decode worker
  the prefill worker and the prefill worker the KV rendezvous at `[::1]`, and the tokens are the reference's;
- each worker's metrics answer at the address it registered;
- `pdserve drain --host ::1` (a pod's preStop with an IPv6 POD_IP, unbracketed) reaches every worker on the host.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.request

import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc
from tests.integration.reference import MAX_TOKENS, PROMPT, greedy_request
from tests.integration.steady_load import tokens

pytestmark = pytest.mark.timeout(300)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--bind-host", "::", "--advertise-host", "::1"]
    proc = ClusterProcess(*args, log_path=tmp_path_factory.mktemp("ipv6") / "cluster.log")
    yield proc
    proc.stop()


def test_requests_over_ipv6_and_ipv4_reach_ipv6_workers(cluster: ClusterProcess, expected: list[int]) -> None:
    async def run() -> admin_pb2.ClusterStatusResponse:
        for i, router in enumerate((f"[::1]:{cluster.port}", f"127.0.0.1:{cluster.port}")):
            assert await tokens(router, greedy_request(f"v6-{i}", PROMPT, MAX_TOKENS)) == expected, router
        async with channel(f"[::1]:{cluster.port}") as ch:
            return await admin_pb2_grpc.AdminStub(ch).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5)

    status = asyncio.run(run())
    assert len(status.workers) == 2
    for w in status.workers:
        assert w.address.startswith("[::1]:") and w.metrics_address.startswith("[::1]:"), w
        with urllib.request.urlopen(f"http://{w.metrics_address}/metrics", timeout=10) as page:
            assert b"pdserve_kv_blocks_total" in page.read(), w.id


def test_a_drain_by_an_unbracketed_ipv6_host_reaches_its_workers(cluster: ClusterProcess) -> None:
    drain = [sys.executable, "-m", "pdserve.cli", "drain", "--addr", cluster.address, "--host", "::1", "--json"]
    out = subprocess.run([*drain, "--timeout", "30"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    drained = [json.loads(line) for line in out.stdout.splitlines()]  # one line per worker
    assert len(drained) == 2, out.stdout
