"""`pdserve scale --kubernetes`: set the chart's RayCluster worker-group replicas.

The chart (deploy/helm/pdserve) names the RayCluster after the release's full name (`<release>-pdserve`,
or the release name alone when it already holds "pdserve", cut to 40 characters, unless nameOverride or
fullnameOverride say otherwise) and lists two worker groups, `prefill` then `decode`. In the chart's
controller pod PDSERVE_RAYCLUSTER holds the rendered name and POD_NAMESPACE the namespace, so a command run
there needs neither. The patch is an RFC 6902 JSON patch: a `test` of each group's name before the `replace`
of its replicas, so a RayCluster whose groups are not where the chart puts them is refused whole instead of
scaled wrong. Where the live object's minReplicas/maxReplicas would not admit the new count, the patch widens
them too (KubeRay rejects replicas outside the range). The API calls are a get and a patch of that one
RayCluster, all the chart's Role allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def replicas_patch(counts: dict[str, int], live: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The JSON patch setting each group in `counts` (prefill, decode) to its count; `live`: the current
    RayCluster, read to widen minReplicas/maxReplicas where needed (None: replicas only)."""
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
        ops.append({"op": "replace", "path": f"{path}/replicas", "value": n})
    return ops


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


def apply_patch(name: str, namespace: str, counts: dict[str, int]) -> tuple[list[dict[str, Any]], list[str]]:
    """Reads the live RayCluster (in-cluster credentials, else ~/.kube/config), patches it, returns the patch and
    the groups it took below their disruption budget's floor (`lowered_floors`)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.CustomObjectsApi()
    live = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    patch = replicas_patch(counts, live)
    # The client's default for a PATCH is a merge patch; ours is a JSON patch (a list of operations).
    api.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, patch, _content_type="application/json-patch+json"
    )
    return patch, lowered_floors(counts, live)
