"""The scale patch applied to the RayCluster the chart really renders (helm template, tests/deploy's renderer).
Runs where the chart and its renderer are present and helm can be fetched."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve import cli
from pdserve.planner.kube_scale import RayClusterApi, apply_patch, raycluster_name, replicas_patch
from tests.unit.planner.json_patch import apply_json_patch

chart = pytest.importorskip("tests.deploy.chart", reason="the chart's renderer (tests/deploy) is not in this tree")


@pytest.fixture(scope="module")
def raycluster() -> dict[str, Any]:
    if chart.helm_binary() is None:
        pytest.skip("the helm binary could not be fetched")
    return chart.one(chart.render(), "RayCluster")


def test_the_patch_names_and_scales_the_rendered_raycluster(raycluster: dict[str, Any]) -> None:
    assert raycluster["metadata"]["name"] == raycluster_name(chart.RELEASE)
    maximum = raycluster["spec"]["workerGroupSpecs"][0]["maxReplicas"]
    patched = apply_json_patch(raycluster, replicas_patch({"prefill": maximum + 2, "decode": 0}, raycluster))
    groups = {g["groupName"]: g for g in patched["spec"]["workerGroupSpecs"]}
    assert groups["prefill"]["replicas"] == groups["prefill"]["maxReplicas"] == maximum + 2
    assert groups["decode"]["replicas"] == groups["decode"]["minReplicas"] == 0


def test_the_pods_to_delete_are_named_in_the_rendered_groups_scale_strategy(raycluster: dict[str, Any]) -> None:
    """KubeRay never clears the list: each patch that names pods sets it whole, whatever an earlier one left."""
    stale = replicas_patch({"decode": 2}, raycluster, {"decode": ["pd-pdserve-decode-worker-old"]})
    later = replicas_patch({"decode": 1}, raycluster, {"decode": ["b"]})
    patched = apply_json_patch(apply_json_patch(raycluster, stale), later)
    prefill, decode = patched["spec"]["workerGroupSpecs"]
    assert decode["scaleStrategy"] == {"workersToDelete": ["b"]} and decode["replicas"] == 1
    assert prefill == raycluster["spec"]["workerGroupSpecs"][0]


def test_a_raycluster_with_its_groups_swapped_is_refused(raycluster: dict[str, Any]) -> None:
    swapped = copy.deepcopy(raycluster)
    swapped["spec"]["workerGroupSpecs"].reverse()
    with pytest.raises(ValueError, match="groupName"):
        apply_json_patch(swapped, replicas_patch({"prefill": 2, "decode": 2}))


class RecordingApi:
    """kubernetes.client.CustomObjectsApi or CoreV1Api, answering with the rendered RayCluster (no pods) and
    recording each call as (resource, verb): the method's first word, `replace` being the API's update."""

    def __init__(self, live: dict[str, Any], calls: set[tuple[str, str]], resource: str) -> None:
        self.live, self.calls, self.resource = live, calls, resource

    def __getattr__(self, method: str) -> Any:
        verb = method.split("_")[0]
        self.calls.add((self.resource, {"replace": "update"}.get(verb, verb)))
        return lambda *args, **kwargs: SimpleNamespace(items=[]) if self.resource == "pods" else self.live


def test_the_role_grants_exactly_the_verbs_the_scale_uses(
    raycluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    kubernetes = pytest.importorskip("kubernetes")
    raycluster = chart.one(chart.render(sets={"ray.autoscaler.enabled": False}), "RayCluster")  # else refused
    calls: set[tuple[str, str]] = set()
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: RecordingApi(raycluster, calls, "rayclusters"))
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: RecordingApi(raycluster, calls, "pods"))
    api = RayClusterApi(raycluster["metadata"]["name"], "serving")
    apply_patch(api, {"prefill": 2, "decode": 2})
    api.worker_pods()
    rules = chart.one(chart.render(), "Role")["rules"]
    granted = {(resource, verb) for rule in rules for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == calls == {("rayclusters", "get"), ("rayclusters", "patch"), ("pods", "list")}
    (objects,) = [rule for rule in rules if rule["resources"] == ["rayclusters"]]
    assert objects["resourceNames"] == [raycluster["metadata"]["name"]]


def test_the_controllers_pod_names_the_raycluster_as_rendered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With fullnameOverride the release name no longer gives the RayCluster's: the controller's pod carries the
    rendered name, which `pdserve scale --kubernetes` run there patches."""
    objects = chart.render(sets={"fullnameOverride": "llm-serving"})
    name = chart.one(objects, "RayCluster")["metadata"]["name"]
    assert name != raycluster_name(chart.RELEASE)
    env = {e["name"]: e for e in chart.pod_templates(objects)["controller"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    monkeypatch.setenv("PDSERVE_RAYCLUSTER", env["PDSERVE_RAYCLUSTER"]["value"])
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    assert cli.main(["scale", "--kubernetes", "--dry-run", "--prefill", "2"]) == 0
    assert f"serving/{name}" in capsys.readouterr().err
