"""The chart's alert rules (monitoring.prometheusRule): rendered only when asked for, beside the monitors whose
series they read; every expression parses as PromQL and selects only metrics, labels and label values pdserve
exports (tests/deploy/exported_series.py reads them from a real registry) and the monitors' own scrape jobs; every
alert says how urgent it is, what to check, and which docs page holds the text to read (its runbook)."""

from __future__ import annotations

import re
from typing import Any

import promql_parser

from tests.deploy.chart import NAMESPACE, RELEASE, Objects, one, render, render_error
from tests.deploy.promql_checks import grouping_errors, scrape_jobs, selection_errors
from tests.docs_pages import ROOT, broken

EXAMPLE = "external-redis-tls-monitoring.yaml"  # both monitors and the rules on
DOCS_PAGE = re.compile(r"docs/[\w-]+\.md(?:#[\w-]+)?")  # a page of the repository's docs, with its anchor


def rules(objects: Objects) -> list[dict[str, Any]]:
    return [r for group in one(objects, "PrometheusRule")["spec"]["groups"] for r in group["rules"]]


def test_the_rules_render_only_when_enabled_and_only_beside_the_monitors(rendered: dict[str, Objects]) -> None:
    assert not [o for o in rendered["gpu.yaml"] if o["kind"] == "PrometheusRule"]
    rule = one(rendered[EXAMPLE], "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"  # what the Prometheus' ruleSelector matches
    for monitor in ("serviceMonitor", "podMonitor"):
        sets = {"monitoring.prometheusRule.enabled": "true", f"monitoring.{monitor}.enabled": "true"}
        assert "needs monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled" in render_error(sets=sets)


def test_every_alert_selects_only_series_pdserve_exports(rendered: dict[str, Objects]) -> None:
    objects = rendered[EXAMPLE]
    jobs = scrape_jobs(objects)
    assert set(jobs) == {f"{RELEASE}-pdserve-router-metrics", f"{NAMESPACE}/{RELEASE}-pdserve-workers"} | {
        f"{NAMESPACE}/{RELEASE}-pdserve-controller"
    }
    for rule in rules(objects):
        expr = promql_parser.parse(rule["expr"])  # ValueError on a syntax error or an unknown function
        assert selection_errors(expr, jobs) + grouping_errors(expr) == [], rule["alert"]


def test_the_check_catches_a_renamed_metric_label_or_value(rendered: dict[str, Objects]) -> None:
    jobs = scrape_jobs(rendered[EXAMPLE])
    scope = f'namespace="{NAMESPACE}", job="{RELEASE}-pdserve-router-metrics"'
    bad = {
        f"rate(pdserve_request_total{{{scope}}}[5m])": "no such metric",
        f"rate(pdserve_time_to_first_token_seconds{{{scope}}}[5m])": "no such metric",  # a histogram's name alone
        f'rate(pdserve_requests_total{{{scope}, status="failed"}}[5m])': "has no label status",
        f'rate(pdserve_requests_total{{{scope}, outcome="error"}}[5m])': "never is 'error'",
        f'rate(pdserve_requests_rejected_total{{{scope}, reason=~"kv|memory"}}[5m])': "never is 'memory'",
        'up{namespace="serving", job="pd-pdserve-router"}': "no monitor's",
        "pdserve_kv_blocks_used": "not scoped",
        f"pdserve_kv_blocks_used{{{scope}}}": "not exported by job pd-pdserve-router-metrics",  # a worker's metric
    }
    for expr, error in bad.items():
        assert error in " ".join(selection_errors(promql_parser.parse(expr), jobs)), expr
    lost = f"sum by (worker) (rate(pdserve_worker_ejections_total{{{scope}}}[5m]))"
    assert grouping_errors(promql_parser.parse(lost)) == ["by (worker): on none of its series"]


def test_every_alert_says_how_urgent_it_is_and_what_to_check(rendered: dict[str, Objects]) -> None:
    alerts = rules(rendered[EXAMPLE])
    assert len(alerts) == len({a["alert"] for a in alerts}) >= 5
    for alert in alerts:
        assert re.fullmatch(r"\d+m", alert["for"]) and alert["labels"]["severity"] in ("critical", "warning"), alert
        summary, description = alert["annotations"]["summary"], alert["annotations"]["description"]
        assert summary, alert["alert"]
        # Where the runbook text is: at least one docs page, each one there, with the heading it names.
        pages = DOCS_PAGE.findall(description)
        assert pages and [broken(page, ROOT) for page in pages] == [None] * len(pages), (alert["alert"], pages)
        assert "pdserve status --addr pd-pdserve-router.serving:50051" in description, alert["alert"]
        # Prometheus' own templates reach it as written, not eaten by Helm's.
        templates = re.findall(r"\{\{.*?\}\}", summary)
        assert all(re.fullmatch(r"\{\{ \$(value|labels\.\w+)( \| \w+)? \}\}", t) for t in templates), summary


def test_the_thresholds_come_from_the_values() -> None:
    thresholds = {"failedShare": 0.2, "shedShare": 0.3, "ttftP90Seconds": 1.5, "ejectionsIn15m": 7, "kvUsedShare": 0.8}
    sets = {f"monitoring.prometheusRule.{k}": v for k, v in thresholds.items()}
    exprs = {r["alert"]: r["expr"] for r in rules(render([EXAMPLE], sets))}
    shown = {
        "failedShare": exprs["PdserveRequestsFailing"],
        "shedShare": exprs["PdserveLoadShedding"],
        "ttftP90Seconds": exprs["PdserveTTFTHigh"],
        "ejectionsIn15m": exprs["PdserveWorkerFlapping"],
        "kvUsedShare": exprs["PdserveKVCacheNearFull"],
    }
    for name, expr in shown.items():
        assert expr.rstrip().endswith(f"> {thresholds[name]}"), (name, expr)
    attainment = rules(render([EXAMPLE], {"monitoring.prometheusRule.sloAttainment": 0.75}))
    assert next(r["expr"] for r in attainment if r["alert"] == "PdserveSLOAttainmentLow").rstrip().endswith("< 0.75")
    assert "exclusiveMinimum" in render_error([EXAMPLE], {"monitoring.prometheusRule.kvUsedShare": 0})
