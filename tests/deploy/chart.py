"""Render the Helm chart with the real helm binary (fetched by `make helm`, or here on first use) and read
the objects back, for tests that check the chart offline: no cluster can run here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pdserve"
EXAMPLES = REPO / "deploy" / "helm" / "examples"
HELM = REPO / ".cache" / "tools" / "helm"
RELEASE = "pd"
NAMESPACE = "serving"  # the release's namespace in every render
# Kinds kubernetes-validate has no schema for; the RayCluster is checked against KubeRay's CRD instead.
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
Objects = list[dict[str, Any]]


@cache
def helm_binary() -> Path | None:
    """The helm binary, fetched once if missing (scripts/fetch_helm.py); None when it cannot be fetched."""
    if not HELM.exists():
        fetch = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_helm.py")], capture_output=True)
        if fetch.returncode != 0:
            return None
    return HELM


@cache
def _helm_home() -> str:
    return tempfile.mkdtemp(prefix="pdserve-helm-")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    binary = helm_binary()
    assert binary is not None
    home = _helm_home()
    env = {"HELM_CACHE_HOME": f"{home}/cache", "HELM_CONFIG_HOME": f"{home}/config", "HELM_DATA_HOME": f"{home}/data"}
    return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=60)


def template_args(values: Iterable[str] = (), sets: Mapping[str, Any] = {}) -> list[str]:
    """`sets`: a str value is a --set (helm parses it: "3" is a number, "0.7" a string), anything else a
    --set-json."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for name in values:
        args += ["-f", str(EXAMPLES / name)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"] if isinstance(value, str) else ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def render(values: Iterable[str] = (), sets: Mapping[str, Any] = {}) -> list[dict[str, Any]]:
    out = helm(*template_args(values, sets))
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.load_all(out.stdout, Loader=LOADER) if d]


def notes(values: Iterable[str] = (), sets: Mapping[str, Any] = {}) -> str:
    """What `helm install` prints after installing (NOTES.txt), rendered offline by a client-side dry run."""
    args = template_args(values, sets)
    out = helm("install", *args[1:], "--dry-run=client")
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\nNOTES:\n", 1)[1]


def render_helper(tmp_path: Path, expression: str) -> Any:
    """What one of the chart's named templates renders to, called as `expression` (`include "pdserve.x" (dict
    ...)`, with any arguments: a lookup's answer, live pods) through a probe chart with the chart as its
    subchart, since `helm template` has nothing live to look up; the result read back as JSON."""
    probe = tmp_path / "probe"
    if not probe.exists():
        shutil.copytree(CHART, probe / "charts" / "pdserve")
        (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.0.1\n")
        (probe / "templates").mkdir()
    value = f"{{{{ {expression} | toJson | quote }}}}"
    (probe / "templates" / "probe.yaml").write_text(
        f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: probe}}\ndata: {{value: {value}}}\n"
    )
    out = helm("template", "pd", str(probe))
    assert out.returncode == 0, out.stderr
    (probe_map,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["metadata"]["name"] == "probe"]
    return json.loads(probe_map["data"]["value"])


def render_error(values: Iterable[str] = (), sets: Mapping[str, Any] = {}) -> str:
    """helm's error for values the chart must refuse (the test fails if it renders)."""
    out = helm(*template_args(values, sets))
    assert out.returncode != 0, f"rendered, but should have been refused: {sets}"
    return out.stderr


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


def worker_groups(objects: Objects) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]}


def container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template the chart renders, by component label: Deployments, StatefulSets, Ray groups, and bare
    Pods (the `helm test` one)."""
    templates = [o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    templates += [{"metadata": o["metadata"], "spec": o["spec"]} for o in objects if o["kind"] == "Pod"]
    for rc in (o for o in objects if o["kind"] == "RayCluster"):
        templates.append(rc["spec"]["headGroupSpec"]["template"])
        templates += [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    return {t["metadata"]["labels"]["app.kubernetes.io/component"]: t for t in templates}


def selects(selector: dict[str, Any], labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, vals = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in vals,
            "NotIn": key not in labels or labels[key] not in vals,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True
