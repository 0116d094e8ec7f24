"""The chart's Grafana dashboard (monitoring.grafanaDashboard, dashboards/pdserve.json): a ConfigMap only when asked
for, beside the monitors whose series it reads, labelled as the values say for the Grafana sidecar; a layout Grafana
draws as written (unique ids, no panels overlapping); every panel's PromQL, once Grafana has put in its variables,
parses and selects only metrics, labels and label values pdserve exports (tests/deploy/exported_series.py) from the
scrape jobs that export them, so a metric renamed in the code leaves no panel silently empty."""

from __future__ import annotations

import copy
import json
import re
from datetime import timedelta
from functools import cache
from typing import Any

import promql_parser

from tests.deploy.chart import CHART, NAMESPACE, RELEASE, Objects, one, render, render_error
from tests.deploy.exported_series import TARGET_LABELS, exported
from tests.deploy.promql_checks import Jobs, grouping_errors, scrape_jobs, selection_errors, selectors

DASHBOARD = CHART / "dashboards" / "pdserve.json"
EXAMPLE = "external-redis-tls-monitoring.yaml"  # both monitors and the dashboard on
# What Grafana puts in before a query reaches Prometheus: the rate window, and the namespace and release (the chart's
# object names' prefix) a user picked. Multi-value variables ($worker_id, $tenant) stay: their label is checked.
RATE_WINDOW = timedelta(minutes=1)
PICKED = {"__rate_interval": "1m", "namespace": NAMESPACE, "release": f"{RELEASE}-pdserve"}
VARIABLE_USE = re.compile(r"\$(\w+)|\$\{(\w+)\}")
LABEL_VALUES = re.compile(r"label_values\((.*), *(\w+)\)")
ROWS = ("SLOs", "Traffic", "Queueing", "KV cache", "KV transfer", "Engine", "Fleet", "Processes")
# kubectl's client-side apply (Argo CD's default) copies the object into an annotation, which holds 256 KiB at most.
LAST_APPLIED_LIMIT = 262144


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included, and those a collapsed row holds."""
    return [p for top in board["panels"] for p in [top, *top.get("panels", [])]]


def variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board["templating"]["list"]}


def substituted(expr: str, board: dict[str, Any]) -> str:
    """`expr` as Grafana sends it; a variable the dashboard does not define fails here."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in PICKED or name in variables(board), f"${name}: no such variable in {expr}"
        return PICKED.get(name, match.group(0))

    return VARIABLE_USE.sub(value, expr)


def result_labels(node: Any) -> set[str]:
    """The labels a query's result series carry, for its legend: an aggregation's `by` labels, a quantile's less le,
    a selector's own and the scrape's."""
    if isinstance(node, promql_parser.AggregateExpr):
        return set(node.modifier.labels) if node.modifier is not None else set()
    if isinstance(node, promql_parser.Call):
        inner = node.args[-1]
        kept = result_labels(inner)
        return kept - {"le"} if node.func.name == "histogram_quantile" else kept
    if isinstance(node, promql_parser.BinaryExpr):
        return result_labels(node.lhs) & result_labels(node.rhs)
    if isinstance(node, promql_parser.ParenExpr):
        return result_labels(node.expr)
    if isinstance(node, promql_parser.MatrixSelector):
        return result_labels(node.vector_selector)
    if isinstance(node, promql_parser.VectorSelector):
        return set(exported().get(node.name, {})) | TARGET_LABELS
    return set()


def shape_errors(expr: promql_parser.Expr) -> list[str]:
    """A window other than $__rate_interval (a fixed one misreads at a long time range or a slow scrape), a quantile
    read other than from `sum by (le, ...)` of a `_bucket`'s rate (the quantile of one series of many)."""
    errors: list[str] = []

    def check(node: Any) -> None:
        if isinstance(node, promql_parser.MatrixSelector) and node.range != RATE_WINDOW:
            errors.append(f"[{node.range}]: not $__rate_interval")
        if isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
            summed = node.args[1]
            ok = isinstance(summed, promql_parser.AggregateExpr) and str(summed.op) == "sum"
            ok = ok and summed.modifier is not None and "le" in summed.modifier.labels
            ok = ok and all(s.name.endswith("_bucket") for s in selectors(summed))
            errors.extend([] if ok else ["histogram_quantile not over sum by (le, ...) of a _bucket's rate"])

    promql_parser.walk(expr, pre_visit=check)
    return errors


def panel_errors(board: dict[str, Any], jobs: Jobs) -> list[str]:
    """What in any panel's queries would draw nothing, or the wrong thing."""
    errors: list[str] = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            try:
                expr = promql_parser.parse(substituted(target["expr"], board))
            except ValueError as error:  # a syntax error or an unknown function
                errors.append(f"{panel['title']}: {error}")
                continue
            found = selection_errors(expr, jobs) + grouping_errors(expr) + shape_errors(expr)
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            found += [f"legend {{{{{label}}}}}: not on its result" for label in legend - result_labels(expr)]
            errors += [f"{panel['title']}: {error}" for error in found]
    return errors


def test_the_dashboard_is_one_grafana_draws_as_written() -> None:
    board = dashboard()
    every = panels(board)
    assert board["uid"] == "pdserve" and board["schemaVersion"] >= 39  # Grafana 10.4 and later
    assert len({p["id"] for p in every}) == len(every), "panel ids repeat"
    cells: dict[tuple[int, int], str] = {}
    for panel in every:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]
    # Top to bottom in the order an SRE reads them: are callers served, then why not.
    rows = [p["title"] for p in sorted(every, key=lambda p: p["gridPos"]["y"]) if p["type"] == "row"]
    assert [next(r for r in ROWS if row.startswith(r)) for row in rows] == list(ROWS), rows
    for panel in (p for p in every if p["type"] != "row"):
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"] and panel["description"], panel
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
    assert variables(board)["datasource"] == {**variables(board)["datasource"], "type": "datasource"}


def test_every_panel_selects_only_series_pdserve_exports(rendered: dict[str, Objects]) -> None:
    assert panel_errors(dashboard(), scrape_jobs(rendered[EXAMPLE])) == []


def test_the_check_catches_a_renamed_metric_label_or_job(rendered: dict[str, Objects]) -> None:
    jobs = scrape_jobs(rendered[EXAMPLE])
    renames = {
        "pdserve_kv_blocks_used{": ("pdserve_kv_blocks_in_use{", "no such metric"),
        "by (worker_id)": ("by (worker)", "by (worker): on none of its series"),
        'tenant=~"$tenant"': ('tenants=~"$tenant"', "has no label tenants"),
        'outcome="failed"': ('outcome="error"', "never is 'error'"),
        "$release-router-metrics": ("$release-router", "no monitor's"),
        "[$__rate_interval]": ("[5m]", "not $__rate_interval"),
        "{{worker_id}}": ("{{pod_name}}", "legend {{pod_name}}: not on its result"),
        "sum by (le)": ("sum by (tenant)", "histogram_quantile not over sum by (le, ...)"),
    }
    for old, (new, error) in renames.items():
        board = copy.deepcopy(dashboard())
        target = next(t for p in panels(board) for t in p.get("targets", []) if old in t["expr"] + t["legendFormat"])
        for field in ("expr", "legendFormat"):
            target[field] = target[field].replace(old, new)
        assert error in " ".join(panel_errors(board, jobs)), (old, new)


def test_the_variables_find_the_release_the_chart_installed(rendered: dict[str, Objects]) -> None:
    """Each variable's query reads a label pdserve's series carry; the release's, the router job's prefix, names the
    jobs the panels read the workers and the controller from."""
    board, jobs = dashboard(), scrape_jobs(rendered[EXAMPLE])
    for name, variable in variables(board).items():
        if variable["type"] != "query":
            continue
        query = LABEL_VALUES.fullmatch(substituted(variable["query"]["query"], board))
        assert query, name
        expr = promql_parser.parse(query.group(1))
        errors = [e for e in selection_errors(expr, jobs) if "not scoped" not in e]
        assert errors == [] and query.group(2) in {*exported()[selectors(expr)[0].name], *TARGET_LABELS}, name
    router_job = next(j for j in jobs if not j.startswith(f"{NAMESPACE}/"))
    regex = variables(board)["release"]["regex"].strip("/")
    assert re.fullmatch(regex, router_job).group(1) == PICKED["release"]  # type: ignore[union-attr]
    assert variables(board)["worker_id"]["multi"] and variables(board)["tenant"]["allValue"] == ".*"


def dashboard_maps(objects: Objects) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{RELEASE}-pdserve-dashboard"]


def test_the_dashboard_renders_only_when_enabled_labelled_for_the_sidecar(rendered: dict[str, Objects]) -> None:
    assert not dashboard_maps(rendered["gpu.yaml"])
    (configmap,) = dashboard_maps(rendered[EXAMPLE])
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's sidecar default
    assert configmap["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert "namespace" not in configmap["metadata"] and "annotations" not in configmap["metadata"]
    assert json.loads(configmap["data"]["pdserve.json"]) == dashboard()
    assert len(json.dumps(configmap)) < LAST_APPLIED_LIMIT  # and so far under a ConfigMap's 1 MiB
    sets = {
        "monitoring.grafanaDashboard.label": "dashboards.example.com/grafana",
        "monitoring.grafanaDashboard.labelValue": "1",  # --set reads a number: written as its digits
        "monitoring.grafanaDashboard.folder": "LLM serving",
        "monitoring.grafanaDashboard.folderAnnotation": "k8s-sidecar-target-directory",
    }
    (configured,) = dashboard_maps(render([EXAMPLE], sets))
    assert configured["metadata"]["labels"]["dashboards.example.com/grafana"] == "1"
    assert "grafana_dashboard" not in configured["metadata"]["labels"]
    assert configured["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "LLM serving"}


def test_the_dashboard_needs_both_monitors_and_sidecar_names() -> None:
    for monitor in ("serviceMonitor", "podMonitor"):
        sets = {"monitoring.grafanaDashboard.enabled": "true", f"monitoring.{monitor}.enabled": "true"}
        assert "needs monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled" in render_error(sets=sets)
    bad = {"label": "grafana dashboard", "labelValue": "-1", "folderAnnotation": "folder/"}
    for key, value in bad.items():
        error = render_error([EXAMPLE], {f"monitoring.grafanaDashboard.{key}": value})
        assert f"at '/monitoring/grafanaDashboard/{key}'" in error, error
    one(render([EXAMPLE], {"monitoring.grafanaDashboard.labelValue": ""}), "ConfigMap", f"{RELEASE}-pdserve-dashboard")
