"""docs/kubernetes.md's Values table says it holds every value of the chart: each one values.yaml sets must be named
there, as its path (`router.extraArgs`) or as a suffix in a row of its siblings (`.pdb.maxUnavailable`). A value
added to the chart without a row otherwise leaves platform engineers to read the templates (`controller.extraArgs`,
which docs/cli.md sends them to, had none)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
# Maps passed into the pod specs or the router's file as they are: the row names the map, not each key of it.
FREE_FORM = {"resources", "fetchResources", "nodeSelector", "affinity", "rayStartParams", "podAnnotations"}
FREE_FORM |= {"annotations", "labels", "config", "env", "secretEnv", "podSecurityContext", "securityContext"}


def leaves(values: dict[str, Any], path: str = "") -> Iterator[str]:
    for key, value in values.items():
        here = f"{path}.{key}" if path else key
        if isinstance(value, dict) and value and key not in FREE_FORM:
            yield from leaves(value, here)
        else:
            yield here


def named(path: str, section: str) -> bool:
    """By its path or a suffix of it in backquotes; a `decode` value by its `prefill` twin's row, each of which says
    "the same for `decode`"."""
    if path.startswith("decode.") and named(path.replace("decode.", "prefill.", 1), section):
        return True
    parts = path.split(".")
    suffixes = {".".join(parts[i:]) for i in range(len(parts))}
    return f"`{path}`" in section or any(f"`.{suffix}`" in section for suffix in suffixes)


def values_section() -> str:
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    return re.search(r"^## Values\n(.*?)^## ", page, re.S | re.M).group(1)  # type: ignore[union-attr]


def test_every_value_of_the_chart_has_a_row_in_the_values_table() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "pdserve" / "values.yaml").read_text())
    section = values_section()
    assert [path for path in leaves(values) if not named(path, section)] == []


def test_a_value_counts_as_named_by_its_path_or_a_suffix_in_backquotes() -> None:
    section = "| `router.replicas`, `.pdb.maxUnavailable` | | replicas and a pdb |"
    assert named("router.replicas", section) and named("router.pdb.maxUnavailable", section)
    assert not named("router.extraArgs", section)  # the word alone is no row
    assert not named("controller.replicas", "| `.pdb` |")
    assert named("decode.gpus", "| `prefill.gpus` | `1` | the same for `decode` |")
