"""`pdserve scale --kubernetes`: set the chart's RayCluster worker-group replicas.

The chart (deploy/helm/pdserve) names the RayCluster after the release's full name (`<release>-pdserve`,
or the release name alone when it already holds "pdserve", cut to 40 characters, unless nameOverride or
fullnameOverride say otherwise) and lists two worker groups, `prefill` then `decode`. In the chart's
controller pod PDSERVE_RAYCLUSTER holds the rendered name and POD_NAMESPACE the namespace, so a command run
there needs neither. The patch is an RFC 6902 JSON patch: a `test` of each group's name before the `replace`
of its replicas, so a RayCluster whose groups are not where the chart puts them is refused whole instead of
scaled wrong. Where the live object's minReplicas/maxReplicas would not admit the new count, the patch widens
them too (KubeRay rejects replicas outside the range). A group losing pods may name the ones to go
(`scaleStrategy.workersToDelete`, which KubeRay deletes whatever else it does and never clears: every patch that
names pods sets the whole list). The API calls are a get and a patch of that one RayCluster and a list of its
worker pods, all the chart's Role allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

from pdserve import env

CHART_NAME = "pdserve"
DEFAULT_RELEASE = "pdserve"
GROUPS = ("prefill", "decode")  # the chart's order of spec.workerGroupSpecs
GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
# Kubernetes mounts the pod's namespace here beside its service account token.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def raycluster_name(release: str) -> str:
    """As the chart's `pdserve.fullname` helper (no nameOverride, no fullnameOverride)."""
    name = release if CHART_NAME in release else f"{release}-{CHART_NAME}"
    return name[:40].rstrip("-")


def target_raycluster(raycluster: str | None, release: str | None) -> str:
    """The RayCluster to patch: the one named, else the chart's name for the release given, else the one this
    pod belongs to (PDSERVE_RAYCLUSTER, which the chart renders with its name overrides), else the chart's name
    for the default release."""
    if raycluster:
        return raycluster
    if release:
        return raycluster_name(release)
    return env.raycluster() or raycluster_name(DEFAULT_RELEASE)


def target_namespace(namespace: str | None) -> str:
    """The namespace given, else, in a pod, the pod's own (POD_NAMESPACE, else its service account's namespace
    file, as the in-cluster client finds it), else "default"."""
    if namespace:
        return namespace
    if pod_namespace := env.pod_namespace():
        return pod_namespace
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    return "default"


def replicas_patch(
    counts: dict[str, int], live: dict[str, Any] | None = None, remove: Mapping[str, Sequence[str]] | None = None
) -> list[dict[str, Any]]:
    """The JSON patch setting each group in `counts` (prefill, decode) to its count; `live`: the current
    RayCluster, read to widen minReplicas/maxReplicas where needed (None: replicas only); `remove`: per group, the
    pods KubeRay is to delete (their names), before it deletes any other it lists first."""
    ops: list[dict[str, Any]] = []
    specs = (live or {}).get("spec", {}).get("workerGroupSpecs", [])
    for index, group in enumerate(GROUPS):
        if group not in counts:
            continue
        n = counts[group]
        if n < 0:
            raise ValueError(f"--{group} must be >= 0, got {n}")
        path = f"/spec/workerGroupSpecs/{index}"
        ops.append({"op": "test", "path": f"{path}/groupName", "value": group})
        current = specs[index] if index < len(specs) else {}
        if "minReplicas" in current and n < current["minReplicas"]:
            ops.append({"op": "replace", "path": f"{path}/minReplicas", "value": n})
        if "maxReplicas" in current and n > current["maxReplicas"]:
            ops.append({"op": "replace", "path": f"{path}/maxReplicas", "value": n})
        if remove and group in remove:  # `add` sets the member whether or not it exists (RFC 6902)
            strategy = {"workersToDelete": list(remove[group])}
            ops.append({"op": "add", "path": f"{path}/scaleStrategy", "value": strategy})
        ops.append({"op": "replace", "path": f"{path}/replicas", "value": n})
    return ops


FLOOR_ADVICE = (
    "its PodDisruptionBudget lets none of its pods be evicted (node drains wait) until "
    "`helm upgrade --set {group}.minReplicas=N` lowers it too"
)


def lowered_floors(counts: dict[str, int], live: dict[str, Any]) -> list[str]:
    """The groups whose pods the patch takes below a live minReplicas of 2 or more, to 1 or more: the chart renders
    a PodDisruptionBudget for such a floor (minAvailable: the floor less one), which then lets none of the group's
    pods be evicted, so node drains wait until a `helm upgrade` lowers `<group>.minReplicas` (and the budget)."""
    specs = live.get("spec", {}).get("workerGroupSpecs", [])
    return [
        group
        for index, group in enumerate(GROUPS)
        if group in counts
        and index < len(specs)
        and 1 <= counts[group] < specs[index].get("minReplicas", 0)
        and specs[index]["minReplicas"] >= 2
    ]


def group_replicas(live: dict[str, Any]) -> dict[str, int]:
    """Each group's replicas in the live RayCluster; ValueError when its groups are not the chart's, in its order."""
    specs = live.get("spec", {}).get("workerGroupSpecs", [])
    names = [spec.get("groupName") for spec in specs]
    if names[: len(GROUPS)] != list(GROUPS):
        raise ValueError(f"its worker groups are {names}, not the chart's {list(GROUPS)}")
    return {group: specs[i].get("replicas", 0) for i, group in enumerate(GROUPS)}


class WorkerPod(NamedTuple):
    name: str
    group: str  # KubeRay's ray.io/group label
    ip: str  # "" before the pod has one
    running: bool  # its phase is Running (before that no Ray node, so no worker, runs in it)
    deleting: bool  # a deletion is under way already


def empty_pods(pods: Iterable[WorkerPod], group: str, worker_hosts: set[str]) -> list[str]:
    """The names of `group`'s pods that host none of the workers (the pod IPs their addresses name) and are not
    being deleted already: those not running yet first, then in name order."""
    empty = [p for p in pods if p.group == group and not p.deleting and not (p.running and p.ip in worker_hosts)]
    return [p.name for p in sorted(empty, key=lambda p: (p.running, p.name))]


class RayClusterApi:
    """The calls `pdserve scale --kubernetes` makes on one RayCluster (in-cluster credentials, else
    ~/.kube/config): get it, JSON-patch it, list its worker pods."""

    def __init__(self, name: str, namespace: str) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.name, self.namespace = name, namespace
        self._objects, self._core = client.CustomObjectsApi(), client.CoreV1Api()

    def get(self) -> dict[str, Any]:
        found = self._objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
        return cast(dict[str, Any], found)  # a custom object is its JSON

    def patch(self, ops: list[dict[str, Any]]) -> None:
        # The client's default for a PATCH is a merge patch; ours is a JSON patch (a list of operations).
        self._objects.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name, ops, _content_type="application/json-patch+json"
        )

    def worker_pods(self) -> list[WorkerPod]:
        selector = f"ray.io/cluster={self.name},ray.io/node-type=worker"  # labels KubeRay sets on its pods
        pods = self._core.list_namespaced_pod(self.namespace, label_selector=selector).items
        found = []
        for p in pods:
            meta, status = p.metadata, p.status
            if meta is None or meta.name is None or status is None:  # typed optional; a listed pod has all three
                continue
            group = (meta.labels or {}).get("ray.io/group", "")
            running, deleted = status.phase == "Running", meta.deletion_timestamp is not None
            found.append(WorkerPod(meta.name, group, status.pod_ip or "", running, deleted))
        return found


def check_replicas_are_ours(live: Mapping[str, Any]) -> None:
    """ValueError when the Ray autoscaler owns the live RayCluster's replicas: it sets them back to what its
    workers need within seconds, so a patch of them alone changed nothing but said it had."""
    if live.get("spec", {}).get("enableInTreeAutoscaling"):
        raise ValueError(
            "the Ray autoscaler owns this RayCluster's pods (the chart's ray.autoscaler.enabled); "
            "scale the workers with --addr alone and it follows them"
        )


def apply_patch(api: RayClusterApi, counts: dict[str, int]) -> tuple[list[dict[str, Any]], list[str]]:
    """Reads the live RayCluster, patches its replicas, returns the patch and the groups it took below their
    disruption budget's floor (`lowered_floors`); ValueError, patching nothing, where the Ray autoscaler owns
    them."""
    live = api.get()
    check_replicas_are_ours(live)
    patch = replicas_patch(counts, live)
    api.patch(patch)
    return patch, lowered_floors(counts, live)
