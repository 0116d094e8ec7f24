"""`pdserve scale`: its flags and how it runs, live through a router, on the chart's RayCluster, or both."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pdserve.addresses import host_port
from pdserve.config import MAX_WORKERS_PER_ROLE
from pdserve.flags import deadline_seconds
from pdserve.protocol.roles import other_mode_role
from pdserve.rpc.client_hints import exit_status, rpc_error_line
from pdserve.rpc.credentials import add_client_flags, client_credentials


def add_scale_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale",
        help="set the worker counts of a running cluster (--addr ROUTER) or of the chart's RayCluster (--kubernetes)",
    )
    p.add_argument(
        "--addr", type=host_port, help="router HOST:PORT: scale the cluster behind it live (pdserve up or controller)"
    )
    p.add_argument("--prefill", type=int, help="prefill workers")
    p.add_argument("--decode", type=int, help="decode workers")
    p.add_argument("--colocated", type=int, help="workers of a colocated cluster (--addr only)")
    p.add_argument("--wait", action="store_true", help="--addr: return once the counts serve (new ones warmed up)")
    p.add_argument("--timeout", type=deadline_seconds, default=600.0, help="seconds --wait waits")
    p.add_argument(
        "--kubernetes",
        action="store_true",
        help="patch the Helm release's RayCluster worker groups; with --addr, where the Ray autoscaler is off: "
        "the pods and their workers together (pods added first; removed ones only once their workers drained)",
    )
    named = p.add_mutually_exclusive_group()
    named.add_argument(
        "--raycluster",
        help="the RayCluster's name (default: $PDSERVE_RAYCLUSTER, set in the chart's controller pod, else the "
        "chart's name for --release)",
    )
    named.add_argument(
        "--release", help="the Helm release name, without nameOverride/fullnameOverride (default: pdserve)"
    )
    p.add_argument(
        "--namespace",
        help="the release's namespace (default: in a pod, its own: $POD_NAMESPACE or the service account's; "
        "else default)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the change (--kubernetes: the JSON patch), make none")
    add_client_flags(p)
    p.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    if not args.addr and not args.kubernetes:
        print(
            "pdserve scale: give --addr ROUTER (a running cluster's workers), --kubernetes (the chart's worker pods), "
            "or both (the pods and their workers, where the Ray autoscaler is off)",
            file=sys.stderr,
        )
        return 2
    roles = ("prefill", "decode") if args.kubernetes else ("prefill", "decode", "colocated")
    if args.kubernetes and args.colocated is not None:
        print(
            "pdserve scale: --colocated is --addr only (the chart's RayCluster runs prefill and decode groups)",
            file=sys.stderr,
        )
        return 2
    counts = {role: n for role in roles if (n := getattr(args, role)) is not None}
    if not counts:
        print(f"pdserve scale: give {' and/or '.join('--' + r for r in roles)}", file=sys.stderr)
        return 2
    if outside := [r for r, n in counts.items() if not 1 <= n <= MAX_WORKERS_PER_ROLE]:
        # A role with no worker serves nothing; pods past the bound would hold workers no router can run.
        print(f"pdserve scale: --{outside[0]} must be 1 to {MAX_WORKERS_PER_ROLE}", file=sys.stderr)
        return 2
    if args.addr and args.kubernetes:
        return _scale_pods_and_workers(args, counts)
    return _scale_live(args, counts) if args.addr else _scale_kubernetes(args, counts)


def _scale_live(args: argparse.Namespace, counts: dict[str, int]) -> int:
    import asyncio

    import grpc

    from pdserve.planner.live_scale import (
        all_counts,
        cluster_status,
        format_counts,
        scale_workers,
        serving_counts,
        wait_settled,
    )

    credentials = client_credentials(args)

    async def run() -> int:
        status = await cluster_status(args.addr, credentials)
        before = dict(status.desired) or all_counts(status)
        # What the router's ScaleWorkers refuses: a dry run printed `1 prefill, 1 decode, 2 colocated`, exit 0.
        if args.dry_run and before and (refused := other_mode_role(counts, "colocated" in before)):
            print(f"pdserve scale: --{refused[0]}: {refused[1]}", file=sys.stderr)
            return 2
        target = {**before, **counts}  # a role not named keeps its count
        if not args.dry_run:  # printed once the router took it: a refused count changes nothing
            reply = await scale_workers(args.addr, credentials, counts)  # the router keeps the others' counts
        print(f"desired: {format_counts(before)} -> {format_counts(target)}")
        print(f"serving: {format_counts(serving_counts(status))}")
        if args.dry_run:
            return 0
        print(f"set: {format_counts(dict(reply.desired))}")
        if not args.wait:
            return 0
        start = time.monotonic()
        try:
            named = {role: n for role, n in reply.desired.items() if role in counts}  # others are another scale's
            await wait_settled(args.addr, credentials, named, args.timeout)
        except TimeoutError as e:
            # The counts stay set: the fleet goes on starting or draining workers to them after this command exits.
            print(f"pdserve scale: not settled: {e}; the counts stay set and the cluster goes on", file=sys.stderr)
            return 1
        print(f"serving: {format_counts(dict(reply.desired))} ({time.monotonic() - start:.1f} s)")
        return 0

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        return _router_refused(e, args)


def _scale_kubernetes(args: argparse.Namespace, counts: dict[str, int]) -> int:
    from pdserve.planner.kube_scale import FLOOR_ADVICE, RayClusterApi, apply_patch

    name, namespace = _raycluster(args)
    try:
        if args.dry_run:
            patch, floors = _dry_run_patch(name, namespace, counts)
        else:
            patch, floors = apply_patch(RayClusterApi(name, namespace), counts)
    except Exception as e:
        return _refused(e, ValueError, f"RayCluster {namespace}/{name}")
    print(f"RayCluster {namespace}/{name} (ray.io/v1):", file=sys.stderr)
    print(json.dumps(patch, indent=1))
    for group in floors:
        advice = FLOOR_ADVICE.format(group=group)
        print(f"pdserve scale: {group} is now below the chart's minReplicas: {advice}", file=sys.stderr)
    return 0


def _dry_run_patch(name: str, namespace: str, counts: dict[str, int]) -> tuple[list[dict[str, Any]], list[str]]:
    """The patch a scale would apply, read against the live RayCluster (the minReplicas/maxReplicas it widens,
    the floors it lowers; ValueError where the scale would refuse it); where that cannot be read (no cluster, no
    rights), the replicas alone, said so."""
    from pdserve.planner.kube_scale import RayClusterApi, check_replicas_are_ours, lowered_floors, replicas_patch

    try:
        live = RayClusterApi(name, namespace).get()
    except Exception as e:  # the kubernetes client's: no credentials, no such object, refused by the API server
        print(f"pdserve scale: RayCluster {namespace}/{name} not read ({e}): the replicas alone", file=sys.stderr)
        return replicas_patch(counts), []
    check_replicas_are_ours(live)
    return replicas_patch(counts, live), lowered_floors(counts, live)


def _scale_pods_and_workers(args: argparse.Namespace, counts: dict[str, int]) -> int:
    import asyncio

    import grpc

    from pdserve.planner.kube_fleet import ScaleRefused, scale_pods_and_workers
    from pdserve.planner.kube_scale import RayClusterApi

    name, namespace = _raycluster(args)
    if args.dry_run:
        return _preview_pods_and_workers(args, counts, name, namespace)

    def report(step: str, patch: list[dict[str, Any]]) -> None:
        print(f"{step}" + (f": RayCluster {namespace}/{name} (ray.io/v1)" if patch else ""), file=sys.stderr)
        if patch:
            print(json.dumps(patch, indent=1), flush=True)

    try:
        api = RayClusterApi(name, namespace)
        asyncio.run(scale_pods_and_workers(api, args.addr, client_credentials(args), counts, args.timeout, report))
    except TimeoutError as e:
        print(f"pdserve scale: workers not settled: {e}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as e:
        return _router_refused(e, args)
    except Exception as e:
        return _refused(e, ScaleRefused, f"RayCluster {namespace}/{name}")
    return 0


def _preview_pods_and_workers(args: argparse.Namespace, counts: dict[str, int], name: str, namespace: str) -> int:
    """The pods' patch as the live RayCluster takes it (the pods that go are known only once their workers
    drained), then the workers' counts."""
    from pdserve.planner.kube_fleet import ScaleRefused, pod_changes
    from pdserve.planner.kube_scale import RayClusterApi, replicas_patch

    try:
        live = RayClusterApi(name, namespace).get()
        _, grow, shrink = pod_changes(live, counts)
    except Exception as e:
        return _refused(e, ScaleRefused, f"RayCluster {namespace}/{name}")
    print(f"RayCluster {namespace}/{name} (ray.io/v1), pods added before the workers:", file=sys.stderr)
    print(json.dumps(replicas_patch(grow, live), indent=1))
    print("after the workers drained, with the pods they left empty in workersToDelete:", file=sys.stderr)
    print(json.dumps(replicas_patch(shrink, live), indent=1))
    return _scale_live(args, counts)


def _raycluster(args: argparse.Namespace) -> tuple[str, str]:
    from pdserve.planner.kube_scale import target_namespace, target_raycluster

    return target_raycluster(args.raycluster, args.release), target_namespace(args.namespace)


def _refused(error: Exception, asked: type[Exception], cluster: str) -> int:
    """Says why the RayCluster was not changed: 2 for what was asked (`asked`: it never works), 1 for the kubernetes
    client's failures (no credentials, no such object, refused by the API server), naming the RayCluster."""
    if isinstance(error, asked):
        print(f"pdserve scale: {error}", file=sys.stderr)
        return 2
    print(f"pdserve scale: {cluster}: {error}", file=sys.stderr)
    return 1


def _router_refused(error: Any, args: argparse.Namespace) -> int:
    """Says what the router answered (with the flag a TLS or key failure calls for); its exit status (`exit_status`).
    `error`: a grpc.aio.AioRpcError."""
    print(
        rpc_error_line("pdserve scale", error.code().name, error.details() or "", client_credentials(args)),
        file=sys.stderr,
    )
    return exit_status(error.code().name)
