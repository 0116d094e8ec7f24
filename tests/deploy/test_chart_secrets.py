"""The secrets the chart generates when no existing Secret is named: internal authentication is on in a default
install (every pdserve process reads the generated cluster secret), and an upgrade keeps each value (`lookup` of the
live Secret). Offline, `helm template` and `helm install --dry-run=client` look up nothing (an empty map), so the
kept path is rendered through a probe chart that hands the chart's helper a live Secret of its own making."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tests.deploy.chart import CHART, one, pod_templates, render, render_helper

PDSERVE_PODS = ("router", "controller", "prefill", "decode")
GENERATED = (("pd-pdserve-cluster", "secret"), ("pd-pdserve-ray-token", "token"), ("pd-pdserve-redis", "password"))
TEMPLATES = ("secrets.yaml", "redis.yaml")  # where they are made


def generated(objects: list[dict[str, Any]], name: str, key: str) -> str:
    return base64.b64decode(one(objects, "Secret", name)["data"][key]).decode()


def env_ref(template: dict[str, Any], name: str) -> dict[str, Any]:
    (env,) = [e for e in template["spec"]["containers"][0]["env"] if e["name"] == name]
    return env["valueFrom"]["secretKeyRef"]


def test_a_default_install_makes_a_cluster_secret_that_every_pdserve_process_reads() -> None:
    """No value set: a random secret, so workers refuse internal RPCs without the token derived from it. `helm
    template` cannot read a live Secret back: each render makes another (why GitOps must name an existing one)."""
    first, second = render(), render()
    for name, key in GENERATED:
        made = generated(first, name, key)
        assert len(made) == 48 and made.isalnum() and generated(second, name, key) != made, name
    templates, ref = pod_templates(first), {"name": "pd-pdserve-cluster", "key": "secret"}
    for component in PDSERVE_PODS:
        assert env_ref(templates[component], "PDSERVE_CLUSTER_SECRET") == ref, component
    named = render(sets={"clusterSecret.existingSecret": "mine"})
    assert not [o for o in named if o["kind"] == "Secret" and o["metadata"]["name"] == "pd-pdserve-cluster"]
    assert env_ref(pod_templates(named)["decode"], "PDSERVE_CLUSTER_SECRET") == {"name": "mine", "key": "secret"}


def kept_value(tmp_path: Path, live: dict[str, Any] | None, key: str = "secret") -> str:
    """What the chart writes at `key` of a generated Secret when the cluster holds `live` (None: no such Secret, as
    on install), through a probe chart with the chart as its subchart."""
    old = "(dict)" if live is None else f"(fromJson `{json.dumps(live)}`)"
    return render_helper(tmp_path, f'include "pdserve.keptValue" (dict "old" {old} "key" "{key}")')


def test_an_upgrade_keeps_the_live_secrets_value_and_replaces_only_a_missing_or_empty_one(tmp_path: Path) -> None:
    """Each generated Secret's value is the live one's, read by a lookup of that Secret in the release's namespace."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert '(lookup "v1" "Secret" .ctx.Release.Namespace .name)' in helpers
    uses = [(CHART / "templates" / t).read_text().count('include "pdserve.keptSecret"') for t in TEMPLATES]
    assert sum(uses) == len(GENERATED)
    value = base64.b64encode(b"x" * 48).decode()
    assert kept_value(tmp_path, {"data": {"secret": value, "other": "eQ=="}}) == value  # `helm upgrade`: kept
    for live in (None, {"data": {"other": "eQ=="}}, {"data": {"secret": ""}}, {"metadata": {"name": "no-data"}}):
        made = base64.b64decode(kept_value(tmp_path, live)).decode()
        assert len(made) == 48 and made.isalnum(), live  # never empty: that would turn internal auth off
        assert made != base64.b64decode(kept_value(tmp_path, live)).decode()
