"""The scale patch applied to the RayCluster the chart really renders (helm template, tests/deploy's renderer).
Runs where the chart and its renderer are present and helm can be fetched."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdserve import cli
from pdserve.planner.kube_scale import apply_patch, raycluster_name, replicas_patch

chart = pytest.importorskip("tests.deploy.chart", reason="the chart's renderer (tests/deploy) is not in this tree")


def apply_json_patch(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `test` and `replace`, all or nothing, as the API server applies them."""
    out = copy.deepcopy(obj)
    for op in patch:
        *parents, leaf = op["path"].strip("/").split("/")
        node: Any = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "test" and node[leaf] != op["value"]:
            raise ValueError(f"test failed at {op['path']}: {node[leaf]!r} != {op['value']!r}")
        if op["op"] == "replace":
            node[leaf] = op["value"]
    return out


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


def test_a_raycluster_with_its_groups_swapped_is_refused(raycluster: dict[str, Any]) -> None:
    swapped = copy.deepcopy(raycluster)
    swapped["spec"]["workerGroupSpecs"].reverse()
    with pytest.raises(ValueError, match="groupName"):
        apply_json_patch(swapped, replicas_patch({"prefill": 2, "decode": 2}))


class RecordingApi:
    """kubernetes.client.CustomObjectsApi, answering with the rendered RayCluster and recording the verb of each
    call (the method's first word; `replace` is the API's update)."""

    def __init__(self, live: dict[str, Any]) -> None:
        self.live = live
        self.verbs: set[str] = set()

    def __getattr__(self, method: str) -> Any:
        verb = method.split("_")[0]
        self.verbs.add({"replace": "update"}.get(verb, verb))
        return lambda *args, **kwargs: self.live


def test_the_role_grants_exactly_the_verbs_the_scale_uses(
    raycluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    kubernetes = pytest.importorskip("kubernetes")
    api = RecordingApi(raycluster)
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: api)
    apply_patch(raycluster["metadata"]["name"], "serving", {"prefill": 2, "decode": 2})
    (rule,) = chart.one(chart.render(), "Role")["rules"]
    assert (rule["resources"], rule["resourceNames"]) == (["rayclusters"], [raycluster["metadata"]["name"]])
    assert set(rule["verbs"]) == api.verbs == {"get", "patch"}


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
