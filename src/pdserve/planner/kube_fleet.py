"""`pdserve scale --kubernetes --addr ROUTER`: a RayCluster's worker pods and the workers on them, changed
together, for the chart with the Ray autoscaler off (with it on, the autoscaler follows the workers by itself:
scale with --addr alone).

Each pod of a group hosts one worker (its role's Ray resource). Pods come before the workers that need them;
workers leave before their pods, and the pods that go are named (`workersToDelete`) among those the drained
workers left empty: lowering replicas alone, KubeRay deletes the first pods it lists, serving workers' among them,
whose drain then restarts the worker (and reloads its model) on an empty pod.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.addresses import host_of
from pdserve.planner.kube_scale import (
    FLOOR_ADVICE,
    WorkerPod,
    check_replicas_are_ours,
    empty_pods,
    group_replicas,
    lowered_floors,
    replicas_patch,
)
from pdserve.planner.live_scale import all_counts, cluster_status, scale_workers, wait_settled
from pdserve.rpc.credentials import ClientCredentials

Report = Callable[[str, list[dict[str, Any]]], None]  # what was done, and the patch it sent ([] for none)


class RayClusterCalls(Protocol):
    """What the scale asks of Kubernetes (kube_scale.RayClusterApi)."""

    def get(self) -> dict[str, Any]: ...

    def patch(self, ops: list[dict[str, Any]]) -> None: ...

    def worker_pods(self) -> list[WorkerPod]: ...


class ScaleRefused(Exception):
    """The change would take a serving worker's pod, fight the Ray autoscaler, or misread the RayCluster."""


def pod_changes(live: dict[str, Any], counts: dict[str, int]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The groups' replicas now, and of `counts` the groups to grow and to shrink; ScaleRefused where the Ray
    autoscaler owns the replicas or the groups are not the chart's."""
    try:
        check_replicas_are_ours(live)
        replicas = group_replicas(live)
    except ValueError as e:
        raise ScaleRefused(str(e)) from None
    grow = {g: n for g, n in counts.items() if n > replicas[g]}
    shrink = {g: n for g, n in counts.items() if n < replicas[g]}
    return replicas, grow, shrink


async def scale_pods_and_workers(
    api: RayClusterCalls,
    addr: str,
    credentials: ClientCredentials,
    counts: dict[str, int],
    timeout_s: float,
    report: Report,
) -> None:
    """Sets each group in `counts` to that many pods and workers: the pods added first, then the workers (waited
    for until they serve, at most `timeout_s`), then the pods their removed workers left empty deleted. The
    router is asked first, so one that cannot be reached changes nothing."""
    live = api.get()
    replicas, grow, shrink = pod_changes(live, counts)
    status = await cluster_status(addr, credentials)
    if status.admitted_local_only:  # its registry did not answer: its ScaleWorkers would fail after the pods came
        raise ScaleRefused(f"the router at {addr} cannot reach its registry (Redis down?): nothing was changed")
    target = {**(dict(status.desired) or all_counts(status)), **counts}
    if grow:
        patch = replicas_patch(grow, live)
        api.patch(patch)
        report("pods added", patch)
    desired = dict((await scale_workers(addr, credentials, target)).desired)
    deadline = time.monotonic() + timeout_s  # one bound for both waits
    status = await wait_settled(addr, credentials, desired, timeout_s)
    report("workers serving", [])
    if not shrink:
        return
    pods = api.worker_pods()
    # Read again after the pod list: a worker restarting meanwhile (its new actor not listed yet when the first
    # status was read) has its pod's IP listed by now, or is seen missing and the scale waits for it.
    again = await wait_settled(addr, credentials, desired, max(0.0, deadline - time.monotonic()))
    hosts = {host_of(w.address) for w in (*status.workers, *again.workers)}
    remove = {}
    for group, n in shrink.items():
        empty = empty_pods(pods, group, hosts)
        if len(empty) < replicas[group] - n:
            raise ScaleRefused(
                f"{group}: {replicas[group] - n} pods must go, but only {len(empty)} host no worker "
                f"({', '.join(empty) or 'none'}); its pods left as they were"
            )
        remove[group] = empty[: replicas[group] - n]
    live = api.get()
    patch = replicas_patch(shrink, live, remove)
    api.patch(patch)
    report("empty pods deleted", patch)
    for group in lowered_floors(shrink, live):
        report(f"{group} is now below the chart's minReplicas: {FLOOR_ADVICE.format(group=group)}", [])
