"""What tests see of a running cluster's workers, from outside: the router's Admin view, and their processes."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc


async def workers(router: str) -> list[admin_pb2.WorkerStatus]:
    """The router's view of every worker: address, health and load (as of the worker's last heartbeat)."""
    async with channel(router) as ch:
        reply = await admin_pb2_grpc.AdminStub(ch).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5)
    return list(reply.workers)


async def by_role(router: str) -> dict[str, admin_pb2.WorkerStatus]:
    """role -> the one worker in that role (its address changes when Ray restarts it)."""
    return {w.role: w for w in await workers(router)}


def idle(w: admin_pb2.WorkerStatus) -> bool:
    """No KV block held for a live sequence or transfer (the prefix cache may keep some), nothing queued."""
    return w.kv_blocks_used == 0 and w.running == 0 and w.waiting == 0


def pid_serving(address: str) -> int:
    """The process listening on `address`'s port (a worker actor Ray started), from /proc."""
    port = int(address.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:  # gone, or not ours to read
            continue
    raise LookupError(f"no process listens on {address}")
