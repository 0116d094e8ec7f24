"""`pdserve drain` and `pdserve restart`: operator commands that reach workers through a router's Admin service.

A drained worker leaves and its supervisor starts a new one in its place, so a drain is a restart: `pdserve drain`
drains the named workers (or every worker on a host: a Kubernetes preStop hook) all at once, and `pdserve restart`
rolls through them one at a time, each drained and then awaited back in placement before the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from pdserve.addresses import host_port
from pdserve.config import ClusterConfig
from pdserve.flags import deadline_seconds, seconds
from pdserve.rpc.client_hints import exit_status, rpc_error_line
from pdserve.rpc.credentials import ClientCredentials, add_client_flags, client_credentials

ANSWER_SLACK_S = 120.0  # past the drain timeout: cut streams' cleanup, the router's own slack
READY_POLL_S = 0.5
SURGE_WAIT_S = 120.0  # a role's only worker restarts in place when its surge does not serve by then


def add_drain_commands(sub: Any) -> None:
    timeout_help = "seconds in-flight requests may take to finish on a draining worker before they move elsewhere"
    drain = sub.add_parser("drain", help="drain workers: out of placement, requests finish or move, then replaced")
    drain.add_argument("--addr", type=host_port, required=True, help="router HOST:PORT")
    drain.add_argument("worker_ids", nargs="*", metavar="WORKER_ID", help="workers to drain (see pdserve status)")
    drain.add_argument("--host", default=None, help="drain every worker advertised on this host instead")
    drain.add_argument("--timeout", type=seconds, default=ClusterConfig.worker_drain_timeout_s, help=timeout_help)
    drain.add_argument("--json", action="store_true", help="one JSON object per worker per line")
    drain.add_argument(
        "--force",
        action="store_true",
        help="drain named workers even when they are every serving worker of a role (requests fail UNAVAILABLE "
        "until a replacement serves; `pdserve restart` surges such a worker instead)",
    )
    add_client_flags(drain)
    drain.set_defaults(func=_drain)

    restart = sub.add_parser("restart", help="rolling restart: drain each worker in turn, wait until it is back")
    restart.add_argument("--addr", type=host_port, required=True, help="router HOST:PORT")
    restart.add_argument("worker_ids", nargs="*", metavar="WORKER_ID", help="workers to restart (default: all)")
    restart.add_argument("--timeout", type=seconds, default=ClusterConfig.worker_drain_timeout_s, help=timeout_help)
    restart.add_argument(
        "--ready-timeout", type=deadline_seconds, default=300.0, help="seconds to wait for each new worker to serve"
    )
    restart.add_argument(
        "--no-surge",
        action="store_true",
        help="restart a role's only worker in place (a gap as long as its restart) instead of scaling its role up "
        "by one first and back after",
    )
    add_client_flags(restart)
    restart.set_defaults(func=_restart)


def _drain(args: argparse.Namespace) -> int:
    if bool(args.worker_ids) == bool(args.host):
        print("pdserve drain: name WORKER_IDs or --host, not both or neither", file=sys.stderr)
        return 2
    creds = client_credentials(args)
    return _run(_drain_named(args, creds), "drain", creds)


async def _drain_named(args: argparse.Namespace, creds: ClientCredentials) -> int:
    import grpc

    if args.worker_ids:
        hint = "`pdserve restart WORKER_ID` surges it instead; "
        try:
            emptied = roles_emptied(await _workers(args.addr, creds), set(args.worker_ids))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.PERMISSION_DENIED and not args.force:
                raise  # the drain's call would most likely fail alike: _run says what fails, with its hints
            # A key that may drain but not read the status (which restart needs too), or a check --force passes:
            # the drain might empty a role, as far as this can tell.
            emptied, hint = [f"could not check that the drain leaves each role a worker ({e.details()})"], ""
        for line in emptied:
            print(f"pdserve drain: {'warning' if args.force else 'refused'}: {line}", file=sys.stderr)
        if emptied and not args.force:
            print(f"pdserve drain: {hint}--force drains anyway", file=sys.stderr)
            return 2
    return await _drain_and_print(args.addr, args.worker_ids, args.host or "", args.timeout, args.json, creds)


def roles_emptied(workers: list[Any], draining: set[str]) -> list[str]:
    """Draining every serving worker of a role leaves it none until a replacement serves: requests meanwhile wait
    the router's no_workers_wait_s, then fail UNAVAILABLE (a review: 3 of 45 at 1.5 req/s). Refused unless --force;
    a host's drain (a preStop hook, which must drain) is never refused."""
    serving = [w for w in workers if w.health == "SERVING" and not w.draining]
    emptied = []
    for role in sorted({w.role for w in serving}):
        ids = {w.id for w in serving if w.role == role}
        if ids <= draining:
            are = "is" if len(ids) == 1 else "are"
            emptied.append(
                f"{', '.join(sorted(ids))} {are} every {role} worker serving: requests would fail UNAVAILABLE until "
                "a replacement serves"
            )
    return emptied


def _restart(args: argparse.Namespace) -> int:
    return _run(_rolling_restart(args), "restart", client_credentials(args))


def _run(work: Any, command: str, creds: ClientCredentials) -> int:
    import grpc

    try:
        return asyncio.run(work)
    except grpc.aio.AioRpcError as e:
        print(rpc_error_line(f"pdserve {command}", e.code().name, e.details() or "", creds), file=sys.stderr)
        return exit_status(e.code().name)


async def _drain_and_print(
    addr: str, worker_ids: list[str], host: str, timeout_s: float, as_json: bool, creds: ClientCredentials
) -> int:
    from pdserve.rpc.server import channel
    from pdserve.v1 import admin_pb2, admin_pb2_grpc

    request = admin_pb2.DrainWorkersRequest(worker_ids=worker_ids, host=host, timeout_s=timeout_s)
    async with channel(addr, credentials=creds) as ch:
        reply = await admin_pb2_grpc.AdminStub(ch).DrainWorkers(
            request, timeout=timeout_s + ANSWER_SLACK_S, metadata=creds.metadata()
        )
    for w in reply.workers:
        print(_json(w) if as_json else _line(w), flush=True)
    if not reply.workers:
        print(f"pdserve drain: no worker on host {host}", file=sys.stderr)
    return 0 if all(w.drained for w in reply.workers) else 1


def _line(w: Any) -> str:
    if not w.drained:
        return f"NOT drained {w.id} at {w.address}: {w.error}"
    return (
        f"drained {w.id} at {w.address} in {w.seconds:.1f} s: held {w.held} requests ({w.kv_blocks_held} KV blocks);"
        f" {w.finished} finished, {w.moved} moved; {w.kv_blocks_left} KV blocks left"
    )


def _json(w: Any) -> str:
    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(w, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))


async def _rolling_restart(args: argparse.Namespace) -> int:
    creds = client_credentials(args)
    workers = await _workers(args.addr, creds)
    ids = args.worker_ids or [w.id for w in sorted(workers, key=lambda w: (w.role, w.id))]
    for worker_id in ids:
        surged = None if args.no_surge else await _surge_if_alone(args, worker_id, creds)
        try:
            restarted = await _restart_one(args, worker_id, creds)
        finally:  # however it ended (a failed drain, Ctrl-C): the role is not left one worker up
            scaled_back = surged is None or await _scale_back(args, surged, creds)
        if not (restarted and scaled_back):
            return 1
    return 0


async def _restart_one(args: argparse.Namespace, worker_id: str, creds: ClientCredentials) -> bool:
    if await _drain_and_print(args.addr, [worker_id], "", args.timeout, False, creds) != 0:
        return False
    start = time.monotonic()
    address = await _until_serving(args.addr, worker_id, args.ready_timeout, creds)
    if address is None:
        print(f"pdserve restart: {worker_id} not back within {args.ready_timeout:g} s", file=sys.stderr)
        return False
    print(f"{worker_id} back at {address} after {time.monotonic() - start:.1f} s", flush=True)
    return True


async def _surge_if_alone(args: argparse.Namespace, worker_id: str, creds: ClientCredentials) -> dict[str, int] | None:
    """When `worker_id` is the only worker of its role serving, its role scaled up by one first, so that one
    serves while it restarts (a user's review saw requests fail UNAVAILABLE for the gap): the counts to scale
    back to. None when it is not alone, or when no surge serves within SURGE_WAIT_S (a router without desired
    counts, a fleet that cannot place one more: said, scaled back, and it restarts in place)."""
    import grpc

    from pdserve.planner.live_scale import cluster_status, scale_workers, serving_counts

    status = await cluster_status(args.addr, creds)
    target = next((w for w in status.workers if w.id == worker_id), None)
    if target is None or target.health != "SERVING" or target.draining:
        return None
    role = target.role
    if serving_counts(status).get(role, 0) != 1:
        return None
    n = status.desired.get(role, 0)  # 0: the registry did not answer; n + 1 would be a guess, perhaps a cut
    if n < 1:
        _in_place(worker_id, f"the router gave no desired count of {role} workers")
        return None
    try:
        await scale_workers(args.addr, creds, {role: n + 1})
    except grpc.aio.AioRpcError as e:
        _in_place(worker_id, f"{role} cannot surge to {n + 1} ({e.code().name}: {e.details()})")
        return None
    print(f"{worker_id} is the only {role} worker serving: scaling {role} to {n + 1} while it restarts", flush=True)
    wait_s = min(SURGE_WAIT_S, args.ready_timeout)
    end = time.monotonic() + wait_s
    while serving_counts(await cluster_status(args.addr, creds)).get(role, 0) < 2:
        if time.monotonic() > end:
            await _scale_back(args, {role: n}, creds)
            _in_place(worker_id, f"no second {role} worker served within {wait_s:g} s")
            return None
        await asyncio.sleep(READY_POLL_S)
    return {role: n}


def _in_place(worker_id: str, why: str) -> None:
    print(f"pdserve restart: warning: {why}: {worker_id} restarts in place", file=sys.stderr)


async def _scale_back(args: argparse.Namespace, counts: dict[str, int], creds: ClientCredentials) -> bool:
    """The fleet picks the worker that leaves (often the surge's, or the restarted one: either is a new process)."""
    from pdserve.planner.live_scale import format_counts, scale_workers, wait_settled

    await scale_workers(args.addr, creds, counts)
    try:
        await wait_settled(args.addr, creds, counts, args.ready_timeout)
    except TimeoutError as e:
        print(f"pdserve restart: scaling back to {format_counts(counts)} did not settle: {e}", file=sys.stderr)
        return False
    print(f"scaled back to {format_counts(counts)}", flush=True)
    return True


async def _workers(addr: str, creds: ClientCredentials) -> list[Any]:
    from pdserve.rpc.server import channel
    from pdserve.v1 import admin_pb2, admin_pb2_grpc

    async with channel(addr, credentials=creds) as ch:
        reply = await admin_pb2_grpc.AdminStub(ch).ClusterStatus(
            admin_pb2.ClusterStatusRequest(), timeout=10, metadata=creds.metadata()
        )
    return list(reply.workers)


async def _until_serving(addr: str, worker_id: str, timeout_s: float, creds: ClientCredentials) -> str | None:
    """The address of the worker with this id once it is in placement again, serving and not draining."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for w in await _workers(addr, creds):
            if w.id == worker_id and w.health == "SERVING" and not w.draining:
                return w.address
        await asyncio.sleep(READY_POLL_S)
    return None
