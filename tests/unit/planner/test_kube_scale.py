"""`pdserve scale --kubernetes`: the JSON patch for the chart's RayCluster."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path

import grpc
import pytest

from pdserve import cli
from pdserve.addresses import host_of
from pdserve.planner import kube_scale
from pdserve.planner.kube_fleet import ScaleRefused, pod_changes, scale_pods_and_workers
from pdserve.planner.kube_scale import (
    GROUPS,
    WorkerPod,
    empty_pods,
    lowered_floors,
    raycluster_name,
    replicas_patch,
    target_namespace,
    target_raycluster,
)
from pdserve.rpc.credentials import ClientCredentials

CHART = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "pdserve"


def test_the_patch_tests_each_group_name_then_sets_its_replicas() -> None:
    assert replicas_patch({"prefill": 3, "decode": 2}) == [
        {"op": "test", "path": "/spec/workerGroupSpecs/0/groupName", "value": "prefill"},
        {"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 3},
        {"op": "test", "path": "/spec/workerGroupSpecs/1/groupName", "value": "decode"},
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 2},
    ]


def test_the_patch_widens_the_live_range_only_where_needed() -> None:
    live = {"spec": {"workerGroupSpecs": [{"minReplicas": 1, "maxReplicas": 8}, {"minReplicas": 2, "maxReplicas": 4}]}}
    patch = replicas_patch({"prefill": 10, "decode": 1}, live)
    assert {"op": "replace", "path": "/spec/workerGroupSpecs/0/maxReplicas", "value": 10} in patch
    assert {"op": "replace", "path": "/spec/workerGroupSpecs/1/minReplicas", "value": 1} in patch
    assert not any(op["path"].endswith(("0/minReplicas", "1/maxReplicas")) for op in patch)
    assert lowered_floors({"prefill": 10, "decode": 1}, live) == ["decode"]  # its budget now blocks drains: said
    assert lowered_floors({"decode": 0}, live) == []  # no pod left: nothing waits
    assert lowered_floors({"prefill": 0, "decode": 3}, live) == []  # a floor of 1 has no budget; 3 is above 2


def test_one_role_alone_leaves_the_other_group_untouched() -> None:
    assert [op["path"] for op in replicas_patch({"decode": 4})] == [
        "/spec/workerGroupSpecs/1/groupName",
        "/spec/workerGroupSpecs/1/replicas",
    ]
    with pytest.raises(ValueError, match="prefill"):
        replicas_patch({"prefill": -1})


def test_pods_to_delete_are_named_in_their_groups_scale_strategy_before_its_replicas() -> None:
    patch = replicas_patch({"prefill": 2, "decode": 1}, None, {"decode": ["pd-decode-b"]})
    assert patch[-2:] == [
        {"op": "add", "path": "/spec/workerGroupSpecs/1/scaleStrategy", "value": {"workersToDelete": ["pd-decode-b"]}},
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 1},
    ]
    assert not any(op["path"].startswith("/spec/workerGroupSpecs/0/scaleStrategy") for op in patch)


def test_the_empty_pods_are_those_no_worker_runs_in_not_running_ones_first() -> None:
    pods = [
        WorkerPod("d-b", "decode", "10.0.0.2", True, False),
        WorkerPod("d-a", "decode", "10.0.0.1", True, False),  # a worker's
        WorkerPod("d-c", "decode", "10.0.0.3", True, True),  # being deleted already
        WorkerPod("d-d", "decode", "", False, False),  # pending: no Ray node, no worker
        WorkerPod("d-0", "decode", "fd00::5", True, False),
        WorkerPod("p-a", "prefill", "10.0.0.4", True, False),  # another group's
    ]
    hosts = {host_of("10.0.0.1:50061"), host_of("[fd00::9]:50061")}
    assert empty_pods(pods, "decode", hosts) == ["d-d", "d-0", "d-b"]
    assert empty_pods(pods, "decode", {*hosts, host_of("[fd00::5]:50061")}) == ["d-d", "d-b"]


def test_a_raycluster_whose_groups_are_not_the_charts_is_refused_before_anything_changes() -> None:
    live = {"spec": {"workerGroupSpecs": [{"groupName": "decode", "replicas": 1}, {"groupName": "prefill"}]}}
    with pytest.raises(ScaleRefused, match="not the chart's"):
        pod_changes(live, {"prefill": 2})
    live["spec"]["workerGroupSpecs"].reverse()
    replicas, grow, shrink = pod_changes(live, {"prefill": 2, "decode": 0})
    assert (replicas, grow, shrink) == ({"prefill": 0, "decode": 1}, {"prefill": 2}, {"decode": 0})


def test_the_raycluster_is_named_as_the_chart_names_it() -> None:
    assert raycluster_name("prod") == "prod-pdserve"
    assert raycluster_name("pdserve") == "pdserve"
    assert raycluster_name("my-pdserve-eu") == "my-pdserve-eu"
    assert raycluster_name("x" * 39 + "-long") == "x" * 39


@pytest.mark.skipif(not CHART.is_dir(), reason="the chart lands with the helm slice")
def test_the_chart_lists_the_groups_in_the_patch_order() -> None:
    template = (CHART / "templates" / "raycluster.yaml").read_text()
    assert re.search(r'range \$role := list "prefill" "decode"', template), "the chart's worker group order changed"
    assert tuple(GROUPS) == ("prefill", "decode")
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'define "pdserve.rayClusterName" -}}{{ include "pdserve.fullname" . }}' in helpers
    assert "trunc 40" in helpers


def test_scale_dry_run_prints_the_patch(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["scale", "--kubernetes", "--dry-run", "--prefill", "2", "--decode", "5", "--release", "prod"]
    assert cli.main([*argv, "--namespace", "serving"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == replicas_patch({"prefill": 2, "decode": 5})
    assert "serving/prod-pdserve" in captured.err
    assert "not read" in captured.err and "the replicas alone" in captured.err  # no cluster here


def test_a_dry_run_shows_the_patch_the_live_raycluster_would_take(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The range it widens and the floor it lowers, as the scale itself would, not the replicas alone."""
    live = RecordingRayCluster()
    for spec in live.live["spec"]["workerGroupSpecs"]:
        spec.update(replicas=2, minReplicas=2, maxReplicas=2)
    monkeypatch.setattr(kube_scale, "RayClusterApi", lambda name, namespace: live)
    assert cli.main(["scale", "--kubernetes", "--dry-run", "--prefill", "1", "--decode", "4"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == replicas_patch({"prefill": 1, "decode": 4}, live.live)
    assert {op["path"].rsplit("/", 1)[1] for op in json.loads(captured.out)} >= {"minReplicas", "maxReplicas"}
    assert "prefill is now below the chart's minReplicas" in captured.err and not live.patches


def test_scale_without_kubernetes_says_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["scale", "--prefill", "2", "--decode", "2"]) == 2
    assert "--kubernetes" in capsys.readouterr().err


@pytest.fixture
def outside_a_pod(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No pod environment; the service account's namespace file, absent until a test writes it."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.delenv("PDSERVE_RAYCLUSTER", raising=False)
    namespace_file = tmp_path / "namespace"
    monkeypatch.setattr(kube_scale, "SERVICE_ACCOUNT_NAMESPACE", namespace_file)
    return namespace_file


def test_the_namespace_defaults_to_the_pods_own(outside_a_pod: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert target_namespace(None) == "default"
    outside_a_pod.write_text("serving\n")  # in a pod: beside the service account token
    assert target_namespace(None) == "serving"
    monkeypatch.setenv("POD_NAMESPACE", "llm")  # the chart's downward API
    assert target_namespace(None) == "llm"
    assert target_namespace("other") == "other"


def test_the_raycluster_named_wins_then_the_release_then_the_pods_own(
    outside_a_pod: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert target_raycluster(None, None) == "pdserve"
    monkeypatch.setenv("PDSERVE_RAYCLUSTER", "llm")  # the chart's controller pod, fullnameOverride=llm
    assert target_raycluster(None, None) == "llm"
    assert target_raycluster(None, "prod") == "prod-pdserve"
    assert target_raycluster("serving-ray", "prod") == "serving-ray"


def test_scale_in_the_controllers_pod_patches_its_own_raycluster(
    outside_a_pod: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDSERVE_RAYCLUSTER", "llm")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    assert cli.main(["scale", "--kubernetes", "--dry-run", "--decode", "3"]) == 0
    assert "serving/llm" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one name or the other
        cli.main(["scale", "--kubernetes", "--dry-run", "--decode", "3", "--raycluster", "a", "--release", "b"])


class RecordingRayCluster:
    """A RayCluster of one pod per group, its autoscaler off, recording the patches sent."""

    def __init__(self) -> None:
        groups = [{"groupName": g, "replicas": 1} for g in GROUPS]
        self.live = {"spec": {"enableInTreeAutoscaling": False, "workerGroupSpecs": groups}}
        self.patches: list[list[dict]] = []

    def get(self) -> dict:
        return self.live

    def patch(self, ops: list[dict]) -> None:
        self.patches.append(ops)

    def worker_pods(self) -> list[WorkerPod]:
        return []


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_replicas_the_ray_autoscaler_owns_are_refused_unpatched(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dry_run: list[str]
) -> None:
    """The chart's default: the autoscaler would set them back to what the workers need, the patch printed as done."""
    owned = RecordingRayCluster()
    owned.live["spec"]["enableInTreeAutoscaling"] = True
    monkeypatch.setattr(kube_scale, "RayClusterApi", lambda name, namespace: owned)
    assert cli.main(["scale", "--kubernetes", "--prefill", "2", "--decode", "1", *dry_run]) == 2
    captured = capsys.readouterr()
    assert "the Ray autoscaler owns this RayCluster's pods" in captured.err and "--addr" in captured.err
    assert not captured.out and not owned.patches


def test_a_router_that_cannot_be_reached_leaves_the_pods_as_they_were() -> None:
    api = RecordingRayCluster()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(scale_pods_and_workers(api, addr, ClientCredentials(), {"decode": 4}, 5, lambda *_: None))
    assert api.patches == []


def test_a_router_without_its_registry_leaves_the_pods_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its status still answers, its own totals only (Redis down): its ScaleWorkers would fail after the pods were
    added, leaving them empty, so nothing is patched."""
    from pdserve.planner import kube_fleet
    from pdserve.v1 import admin_pb2 as apb

    async def status(addr: str, credentials: ClientCredentials) -> apb.ClusterStatusResponse:
        return apb.ClusterStatusResponse(admitted_local_only=True)

    monkeypatch.setattr(kube_fleet, "cluster_status", status)
    api = RecordingRayCluster()
    with pytest.raises(ScaleRefused, match="cannot reach its registry"):
        asyncio.run(scale_pods_and_workers(api, "router:50051", ClientCredentials(), {"decode": 4}, 5, print))
    assert api.patches == []


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_raycluster_the_scale_cannot_apply_is_2_and_one_the_api_will_not_give_is_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dry_run: list[str]
) -> None:
    """What was asked never works (exit 2, its reason alone), before the router is called; the kubernetes client's
    failure names the RayCluster (exit 1: a retry, or credentials, may mend it)."""
    foreign = RecordingRayCluster()
    foreign.live["spec"]["workerGroupSpecs"] = [{"groupName": "gpu", "replicas": 1}]
    monkeypatch.setattr(kube_scale, "RayClusterApi", lambda name, namespace: foreign)
    argv = ["scale", "--kubernetes", "--addr", "127.0.0.1:1", "--raycluster", "rc", "--namespace", "ns"]
    argv += ["--prefill", "2", "--decode", "1", *dry_run]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("pdserve scale: its worker groups are ['gpu']")

    class Unreachable(RecordingRayCluster):
        def get(self) -> dict:
            raise ConnectionError("the API server did not answer")

    monkeypatch.setattr(kube_scale, "RayClusterApi", lambda name, namespace: Unreachable())
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == "pdserve scale: RayCluster ns/rc: the API server did not answer\n"
