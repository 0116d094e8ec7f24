"""The router's public Service: what its ports declare to a mesh."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from tests.deploy.chart import one, render
from tests.deploy.test_chart_validates import KUBERNETES_VERSION

ROUTER = "pd-pdserve-router"


def app_protocols(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    return {p["name"]: p.get("appProtocol") for p in one(objects, "Service", name)["spec"]["ports"]}


def test_ports_that_carry_tls_are_declared_as_tls() -> None:
    """A mesh reads appProtocol (Istio: before the port name) to pick how it proxies a port: `grpc` or `http` on a
    port that speaks TLS would be parsed as plaintext. With TLS both public ports are `https` (an IANA name, which
    Istio passes through as TLS); /metrics stays plaintext HTTP either way."""
    assert app_protocols(render(), ROUTER) == {"grpc": "grpc", "http": "http"}
    tls = render(["external-redis-tls-monitoring.yaml"])
    assert app_protocols(tls, ROUTER) == {"grpc": "https", "http": "https"}
    assert app_protocols(tls, f"{ROUTER}-metrics") == {"metrics": "http"}
    kubernetes_validate.validate(one(tls, "Service", ROUTER), KUBERNETES_VERSION, strict=True)
