"""Checks of the PromQL the chart ships (alert rules, the Grafana dashboard) against what pdserve really exports
(tests/deploy/exported_series.py) and the scrape jobs the chart's monitors make: a metric, label or label value
renamed in the code, or a job renamed in the chart, fails them instead of leaving an alert or a panel silent."""

from __future__ import annotations

import re
from typing import Any

import promql_parser

from tests.deploy.chart import NAMESPACE, Objects, one, pod_templates, selects
from tests.deploy.exported_series import TARGET_LABELS, Series, exported, exported_by_component, merged

WORD = re.compile(r"[A-Za-z0-9_]*")
# A Grafana template variable standing for a label's value ($worker_id, ${tenant}): it takes the values the
# variable's own query finds, so only its label is checked.
VARIABLE = re.compile(r"\$(\w+|\{\w+\})")
Jobs = dict[str, Series]  # a scrape job -> the series its targets export


def scrape_jobs(objects: Objects) -> Jobs:
    """The job labels prometheus-operator gives the monitors' targets (a ServiceMonitor's: the name of the Service it
    selects; a PodMonitor's: <namespace>/<its name>), each with the series of the pods it scrapes."""
    pods = pod_templates(objects)

    def series_of(pod_selector: dict[str, Any]) -> Series:
        chosen = [c for c, t in pods.items() if selects(pod_selector, t["metadata"]["labels"])]
        return merged(*(exported_by_component()[c] for c in chosen if c in exported_by_component()))

    jobs: Jobs = {}
    service_selector = one(objects, "ServiceMonitor")["spec"]["selector"]
    for service in (o for o in objects if o["kind"] == "Service"):
        if selects(service_selector, service["metadata"]["labels"]):
            jobs[service["metadata"]["name"]] = series_of({"matchLabels": service["spec"]["selector"]})
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        jobs[f"{NAMESPACE}/{monitor['metadata']['name']}"] = series_of(monitor["spec"]["selector"])
    return jobs


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


def selection_errors(expr: promql_parser.Expr, jobs: Jobs) -> list[str]:
    """What in `expr` selects nothing pdserve exports: an unknown metric, a label its series lack, a value its label
    never takes, a job or namespace that is not this release's, a metric its job's targets do not export."""
    errors: list[str] = []
    for selector in selectors(expr):
        matchers = {m.name: m for m in selector.matchers.matchers}
        named_jobs = matchers["job"].value.split("|") if "job" in matchers else []
        errors += [f"job {job}: no monitor's" for job in named_jobs if job not in jobs]
        known = named_jobs and all(job in jobs for job in named_jobs)
        series = merged(*(jobs[job] for job in named_jobs)) if known else exported()
        labels = series.get(selector.name)
        if labels is None:
            where = f"not exported by job {'|'.join(named_jobs)}" if selector.name in exported() else "no such metric"
            errors.append(f"{selector.name}: {where}")
            continue
        for matcher in selector.matchers.matchers:
            if matcher.name == "job":
                continue
            if matcher.name == "namespace":
                errors += [] if matcher.value == NAMESPACE else [f"namespace {matcher.value}: not the release's"]
            elif matcher.name not in labels:
                errors.append(f"{selector.name} has no label {matcher.name}")
            elif not VARIABLE.fullmatch(matcher.value):
                missing = [v for v in matched_values(matcher) if v not in labels[matcher.name]]
                errors += [f"{selector.name}{{{matcher.name}}} never is {v!r}" for v in missing]
        if not set(matchers) >= {"job", "namespace"}:
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
