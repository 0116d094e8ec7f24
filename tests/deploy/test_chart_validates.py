"""The chart lints with --strict, and every object it renders from each example values file is valid:
core kinds against Kubernetes' own schemas (kubernetes-validate, strict, 1.33), the RayCluster against
KubeRay's CRD schema."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import CHART, CUSTOM_KINDS, EXAMPLES, LOADER, helm, one, render
from tests.deploy.conftest import EXAMPLE_FILES

KUBERNETES_VERSION = "1.33.0"
CRD = Path(__file__).parent / "data" / "ray.io_rayclusters.yaml"


@cache
def raycluster_validator() -> jsonschema.Draft7Validator:
    """Built once: jsonschema.validate() would re-check the 0.9 MB schema itself on every call."""
    crd = yaml.load(CRD.read_text(), Loader=LOADER)  # libyaml takes ~1 s, pure Python ~10 s
    return jsonschema.Draft7Validator(
        next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    )


def check_raycluster(obj: dict[str, Any]) -> None:
    raycluster_validator().validate(obj)


@pytest.mark.parametrize("values", EXAMPLE_FILES)
def test_lint_strict(values: str) -> None:
    out = helm("lint", "--strict", str(CHART), "-f", str(EXAMPLES / values))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", EXAMPLE_FILES)
def test_core_objects_valid(rendered: dict[str, list[dict[str, Any]]], values: str) -> None:
    core = [o for o in rendered[values] if o["kind"] not in CUSTOM_KINDS]
    assert len(core) >= 12
    for obj in core:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {e}")


@pytest.mark.parametrize("values", EXAMPLE_FILES)
def test_raycluster_valid_against_kuberay_crd(rendered: dict[str, list[dict[str, Any]]], values: str) -> None:
    check_raycluster(one(rendered[values], "RayCluster"))


def test_crd_check_catches_a_bad_worker_group(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The CRD check can fail: KubeRay requires minReplicas and maxReplicas on each worker group."""
    rc = copy.deepcopy(one(rendered["gpu.yaml"], "RayCluster"))
    del rc["spec"]["workerGroupSpecs"][0]["minReplicas"]
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        check_raycluster(rc)


def test_strict_validation_catches_an_unknown_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = copy.deepcopy(one(rendered["gpu.yaml"], "Deployment", "pd-pdserve-router"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _nulls(node: Any, path: str) -> list[str]:
    if node is None:
        return [path]
    if isinstance(node, dict):
        return [n for k, v in node.items() for n in _nulls(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [n for i, v in enumerate(node) for n in _nulls(v, f"{path}[{i}]")]
    return []


def test_no_field_renders_empty(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """An optional block left out must leave no `key:` with nothing under it (null), here or with the
    optional parts off."""
    bare = render(
        sets={
            "model.fetch": "false",
            "ray.authToken.enabled": "false",
            "networkPolicy.enabled": "false",
            "ray.authToken.allowUnauthenticated": "true",  # both guards off: refused without it
        }
    )
    for name, objects in [*rendered.items(), ("bare", bare)]:
        for obj in objects:
            assert not _nulls(obj, f"{name}:{obj['kind']}/{obj['metadata']['name']}")


def test_the_charts_ray_version_is_the_one_the_image_pins() -> None:
    """KubeRay's head runs `ray.version`'s image, and Ray refuses nodes and clients of any other version: the
    package pins Ray exactly, so an image rebuilt later carries the same Ray as the head it joins."""
    pyproject = (CHART.parents[2] / "pyproject.toml").read_text()
    (pin,) = [line.split('"')[1] for line in pyproject.splitlines() if line.strip().startswith('"ray==')]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert pin == f"ray=={values['ray']['version']}"


def test_gpu_platform_settings_reach_every_pod_and_stay_valid() -> None:
    """A GPU node whose container runtime is not the default (k3s, RKE2: runtimeClassName nvidia), priorities for
    preemption, pod annotations (a mesh, a queue), and a proxy for the model fetch's PyPI download."""
    proxy = {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}
    sets: dict[str, Any] = {"model.fetchEnv": [proxy], "router.priorityClassName": "serving"}
    sets |= {"router.podAnnotations": {"sidecar.istio.io/inject": "false"}}
    for role in ("prefill", "decode"):
        sets |= {f"{role}.runtimeClassName": "nvidia", f"{role}.priorityClassName": "gpu-serving"}
        sets |= {f"{role}.podAnnotations": {"kueue.x-k8s.io/queue-name": "serving"}}
    objects = render(["gpu.yaml"], sets)
    rc = one(objects, "RayCluster")
    check_raycluster(rc)
    for group in rc["spec"]["workerGroupSpecs"]:
        template = group["template"]
        assert (
            template["spec"]["runtimeClassName"] == "nvidia" and template["spec"]["priorityClassName"] == "gpu-serving"
        )
        assert template["metadata"]["annotations"] == {"kueue.x-k8s.io/queue-name": "serving"}
        assert proxy in template["spec"]["initContainers"][0]["env"]
    router = one(objects, "Deployment", "pd-pdserve-router")
    kubernetes_validate.validate(router, KUBERNETES_VERSION, strict=True)
    assert router["spec"]["template"]["spec"]["priorityClassName"] == "serving"
    assert router["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


def test_the_install_guide_installs_a_kuberay_that_has_every_raycluster_field_the_chart_sets() -> None:
    """spec.upgradeStrategy came with KubeRay 1.6.0 (ray-project/kuberay#4185), gcsFaultToleranceOptions with 1.3.0;
    an older CRD prunes them silently, so the operator install in docs/kubernetes.md pins a version that has both."""
    spec = raycluster_validator().schema["properties"]["spec"]["properties"]
    assert {"upgradeStrategy", "gcsFaultToleranceOptions"} <= set(spec)
    guide = (CHART.parents[2] / "docs" / "kubernetes.md").read_text()
    (install,) = [line for line in guide.splitlines() if line.startswith("helm install kuberay-operator")]
    argv = install.split()
    version = tuple(int(n) for n in argv[argv.index("--version") + 1].removeprefix("v").split("."))
    assert version >= (1, 6, 0), install
