"""`pdserve scale --kubernetes --addr ROUTER`: a RayCluster's worker pods and the workers on them, changed
together, for the chart with the Ray autoscaler off (with it on, the autoscaler follows the workers by itself:
scale with --addr alone).

Each pod of a group hosts one worker (its role's Ray resource). Pods come before the workers that need them;
workers leave before their pods, and the pods that go are named (`workersToDelete`) among those the drained
workers left empty: lowering replicas alone, KubeRay deletes the first pods it lists, serving workers' among them,
whose drain then restarts the worker (and reloads its model) on an empty pod.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pdserve.addresses import host_of
from pdserve.planner.kube_scale import WorkerPod, empty_pods, group_replicas, replicas_patch
from pdserve.planner.live_scale import all_counts, cluster_status, scale_workers, wait_settled
from pdserve.rpc.credentials import ClientCredentials

Report = Callable[[str, list[dict[str, Any]]], None]  # what was done, and the patch it sent ([] for none)


class RayClusterCalls(Protocol):
    """What the scale asks of Kubernetes (kube_scale.RayClusterApi)."""

    def get(self) -> dict[str, Any]: ...

    def patch(self, ops: list[dict[str, Any]]) -> None: ...

    def worker_pods(self) -> list[WorkerPod]: ...


class ScaleRefused(Exception):
    """The change would take a serving worker's pod, or fight the Ray autoscaler: nothing more is changed."""


async def scale_pods_and_workers(
    api: RayClusterCalls,
    addr: str,
    credentials: ClientCredentials,
    counts: dict[str, int],
    timeout_s: float,
    report: Report,
) -> None:
    """Sets each group in `counts` to that many pods and workers: the pods added first, then the workers (waited
    for until they serve, at most `timeout_s`), then the pods their removed workers left empty deleted."""
    live = api.get()
    if live.get("spec", {}).get("enableInTreeAutoscaling"):
        raise ScaleRefused(
            "the Ray autoscaler owns this RayCluster's pods (the chart's ray.autoscaler.enabled); "
            "scale the workers with --addr alone and it follows them"
        )
    replicas = group_replicas(live)
    grow = {g: n for g, n in counts.items() if n > replicas[g]}
    shrink = {g: n for g, n in counts.items() if n < replicas[g]}
    if grow:
        patch = replicas_patch(grow, live)
        api.patch(patch)
        report("pods added", patch)
    status = await cluster_status(addr, credentials)
    target = {**(dict(status.desired) or all_counts(status)), **counts}
    desired = dict((await scale_workers(addr, credentials, target)).desired)
    status = await wait_settled(addr, credentials, desired, timeout_s)
    report("workers serving", [])
    if not shrink:
        return
    hosts = {host_of(w.address) for w in status.workers}
    pods = api.worker_pods()
    remove = {}
    for group, n in shrink.items():
        empty = empty_pods(pods, group, hosts)
        if len(empty) < replicas[group] - n:
            raise ScaleRefused(
                f"{group}: {replicas[group] - n} pods must go, but only {len(empty)} host no worker "
                f"({', '.join(empty) or 'none'}); its pods left as they were"
            )
        remove[group] = empty[: replicas[group] - n]
    patch = replicas_patch(shrink, api.get(), remove)
    api.patch(patch)
    report("empty pods deleted", patch)
