"""RFC 6902 JSON patches applied as the Kubernetes API server applies them, for the RayCluster patches' tests."""

from __future__ import annotations

import copy
from typing import Any


def apply_json_patch(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """`test`, `replace` and `add` (of an object member, which it sets whether or not it exists), all or nothing."""
    out = copy.deepcopy(obj)
    for op in patch:
        *parents, leaf = op["path"].strip("/").split("/")
        node: Any = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "test" and node[leaf] != op["value"]:
            raise ValueError(f"test failed at {op['path']}: {node[leaf]!r} != {op['value']!r}")
        if op["op"] == "replace" and leaf not in node:
            raise ValueError(f"replace of a missing member at {op['path']}")
        if op["op"] in ("replace", "add"):
            node[leaf] = copy.deepcopy(op["value"])
    return out
