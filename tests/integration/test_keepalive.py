"""Internal channels keep alive: a long quiet stream survives the pings, a stopped peer fails it within seconds.

The server runs in a process of its own (our `Server`, health service only) so the test can SIGSTOP it: its
kernel still holds the TCP connection open, and only the unanswered HTTP/2 pings can tell the caller.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, channel

pytestmark = pytest.mark.timeout(120)
SERVER = """
import asyncio
from pdserve.rpc.server import Server

async def main():
    server = Server("127.0.0.1", 0)
    await server.start()
    await server.set_serving(True)
    print(server.address, flush=True)
    await server.wait()

asyncio.run(main())
"""


def test_quiet_stream_survives_and_a_stopped_server_fails_it():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address, "the server did not start"
        asyncio.run(_watch_then_stop(address, proc.pid))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


async def _watch_then_stop(address: str, pid: int) -> None:
    keepalive_s, timeout_s = KEEPALIVE_TIME_MS / 1e3, KEEPALIVE_TIMEOUT_MS / 1e3
    async with channel(address) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await call.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        nothing_more = asyncio.ensure_future(call.read())  # the status never changes: no data on the stream
        # Three pings without data: a server that does not permit them answers the third with GOAWAY.
        await asyncio.sleep(3 * keepalive_s + 2)
        assert not nothing_more.done(), nothing_more
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(nothing_more, timeout=keepalive_s + timeout_s + 10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert time.monotonic() - stopped < keepalive_s + timeout_s + 5
