"""The router's public Service: what its ports declare to a mesh, and the load balancer settings it takes (each
rendered only when set, and refused on a Service type Kubernetes refuses it for)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.chart import one, render, render_error
from tests.deploy.test_chart_validates import KUBERNETES_VERSION

ROUTER = "pd-pdserve-router"
EXPOSED = {"router.service.type": "LoadBalancer", "router.service.allowUnauthenticated": "true"}


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


def test_load_balancer_settings_render_when_set_and_only_then() -> None:
    sets = {
        **EXPOSED,
        "router.service.externalTrafficPolicy": "Local",
        "router.service.loadBalancerClass": "service.k8s.aws/nlb",
        "router.service.loadBalancerSourceRanges": ["10.0.0.0/8", "fd00::/8"],
    }
    service = one(render(sets=sets), "Service", ROUTER)
    assert service["spec"]["externalTrafficPolicy"] == "Local"
    assert service["spec"]["loadBalancerClass"] == "service.k8s.aws/nlb"
    assert service["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8", "fd00::/8"]
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    spec = one(render(sets=EXPOSED), "Service", ROUTER)["spec"]
    assert not {"externalTrafficPolicy", "loadBalancerClass", "loadBalancerSourceRanges"} & set(spec)
    node_port = {"router.service.type": "NodePort", "router.service.externalTrafficPolicy": "Cluster"}
    node_port_service = one(render(sets={**EXPOSED, **node_port}), "Service", ROUTER)
    assert node_port_service["spec"]["externalTrafficPolicy"] == "Cluster"


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        # Kubernetes refuses each on these types, at apply time: the chart says so at render, naming the fix.
        (
            {"router.service.externalTrafficPolicy": "Local"},
            "router.service.externalTrafficPolicy (Local) applies to external traffic only",
        ),
        (
            {**EXPOSED, "router.service.type": "NodePort", "router.service.loadBalancerSourceRanges": ["10.0.0.0/8"]},
            "router.service.loadBalancerSourceRanges is only for a LoadBalancer Service, and router.service.type is",
        ),
        (
            {"router.service.loadBalancerClass": "example.com/internal"},
            "set router.service.type=LoadBalancer, or leave it empty",
        ),
        ({**EXPOSED, "router.service.externalTrafficPolicy": "local"}, "/router/service/externalTrafficPolicy"),
        ({**EXPOSED, "router.service.loadBalancerSourceRanges": ["10.0.0.0"]}, "/router/service/loadBalancer"),
        ({**EXPOSED, "router.service.loadBalancerClass": "a b"}, "/router/service/loadBalancerClass"),
    ],
)
def test_load_balancer_settings_are_refused_where_they_do_not_apply(sets: dict[str, Any], named: str) -> None:
    assert named in render_error(sets=sets)
