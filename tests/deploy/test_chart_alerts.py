"""The chart's alert rules (monitoring.prometheusRule): rendered only when asked for, beside the monitors whose
series they read; every expression parses as PromQL and selects only metrics, labels and label values pdserve
exports (tests/deploy/exported_series.py reads them from a real registry) and the monitors' own scrape jobs; every
alert says how urgent it is, what to check, and which docs page holds the text to read (its runbook)."""

from __future__ import annotations

import re
from typing import Any

import promql_parser

from tests.deploy.chart import RELEASE, one, render, render_error, selects
from tests.deploy.exported_series import TARGET_LABELS, exported
from tests.docs_pages import ROOT, broken

Objects = list[dict[str, Any]]
NAMESPACE = "serving"  # chart.template_args' --namespace
EXAMPLE = "external-redis-tls-monitoring.yaml"  # both monitors and the rules on
WORD = re.compile(r"[A-Za-z0-9_]*")
DOCS_PAGE = re.compile(r"docs/[\w-]+\.md(?:#[\w-]+)?")  # a page of the repository's docs, with its anchor


def rules(objects: Objects) -> list[dict[str, Any]]:
    return [r for group in one(objects, "PrometheusRule")["spec"]["groups"] for r in group["rules"]]


def scrape_jobs(objects: Objects) -> set[str]:
    """The job labels prometheus-operator gives the monitors' targets: a ServiceMonitor's, the name of the Service it
    selects; a PodMonitor's, <namespace>/<its name>."""
    selector = one(objects, "ServiceMonitor")["spec"]["selector"]
    services = [o["metadata"] for o in objects if o["kind"] == "Service"]
    jobs = {s["name"] for s in services if selects(selector, s["labels"])}
    return jobs | {f"{NAMESPACE}/{o['metadata']['name']}" for o in objects if o["kind"] == "PodMonitor"}


def selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    found: list[Any] = []
    promql_parser.walk(expr, pre_visit=found.append)
    return [n for n in found if isinstance(n, promql_parser.VectorSelector)]


def matched_values(matcher: promql_parser.Matcher) -> list[str]:
    """The values an = or != matcher names, or each alternative of a =~ or !~ one (which must be plain words: a
    wider pattern could match nothing without anyone noticing)."""
    if str(matcher.op) in ("MatchOp.Equal", "MatchOp.NotEqual"):
        return [matcher.value]
    alternatives = matcher.value.split("|")
    assert all(WORD.fullmatch(a) for a in alternatives), f"{matcher.name}=~{matcher.value!r}: not a list of words"
    return alternatives


def selection_errors(expr: promql_parser.Expr, jobs: set[str]) -> list[str]:
    """What in `expr` selects nothing pdserve exports: an unknown metric, a label its series lack, a value its label
    never takes, a job or namespace that is not this release's."""
    series, errors = exported(), []
    for selector in selectors(expr):
        labels = series.get(selector.name)
        if labels is None:
            errors.append(f"{selector.name}: no such metric")
            continue
        for matcher in selector.matchers.matchers:
            if matcher.name == "job":
                errors += [f"job {v}: no monitor's" for v in matcher.value.split("|") if v not in jobs]
            elif matcher.name == "namespace":
                errors += [] if matcher.value == NAMESPACE else [f"namespace {matcher.value}: not the release's"]
            elif matcher.name not in labels:
                errors.append(f"{selector.name} has no label {matcher.name}")
            else:
                missing = [v for v in matched_values(matcher) if v not in labels[matcher.name]]
                errors += [f"{selector.name}{{{matcher.name}}} never is {v!r}" for v in missing]
        if not {m.name for m in selector.matchers.matchers} >= {"job", "namespace"}:
            errors.append(f"{selector.name}: not scoped to the release's jobs and namespace")
    return errors


def grouping_errors(expr: promql_parser.Expr) -> list[str]:
    """Labels an aggregation keeps (`by`) that none of the series it aggregates carries: it would sum them away."""
    errors: list[str] = []

    def check(node: Any) -> None:
        if not isinstance(node, promql_parser.AggregateExpr) or node.modifier is None:
            return
        present = set(TARGET_LABELS)
        for selector in selectors(node.expr):
            present |= set(exported().get(selector.name, {}))
        errors.extend(f"by ({label}): on none of its series" for label in node.modifier.labels if label not in present)

    promql_parser.walk(expr, pre_visit=check)
    return errors


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
    assert jobs == {f"{RELEASE}-pdserve-router-metrics", f"{NAMESPACE}/{RELEASE}-pdserve-workers"} | {
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
