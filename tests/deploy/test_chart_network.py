"""NetworkPolicies select the pods the chart renders and let through exactly the flows pdserve needs;
Redis, secrets, RBAC and monitoring are wired to the objects they name."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chart import one, pod_templates, render, render_error, selects
from tests.deploy.test_chart_validates import check_raycluster

Objects = list[dict[str, Any]]


def labels(objects: Objects) -> dict[str, dict[str, str]]:
    return {c: t["metadata"]["labels"] for c, t in pod_templates(objects).items()}


def allowed(objects: Objects, source: str, target: str, port: int) -> bool:
    """Whether the policies let `source` pods reach `target` pods on `port` (ingress; pods of no policy
    are open)."""
    pods = labels(objects)
    policies = [p for p in objects if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], pods[target])]
    if not policies:
        return True
    for rule in (r for p in policies for r in p["spec"].get("ingress", [])):
        ports = [p["port"] for p in rule.get("ports", [])]
        peers = rule.get("from")
        if (not ports or port in ports) and (
            peers is None or any(selects(peer["podSelector"], pods[source]) for peer in peers if "podSelector" in peer)
        ):
            return True
    return False


def test_every_selector_matches_rendered_pods(rendered: dict[str, Objects]) -> None:
    for values, objects in rendered.items():
        pods = labels(objects)
        for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
            name = policy["metadata"]["name"]
            assert any(selects(policy["spec"]["podSelector"], pod) for pod in pods.values()), (values, name)
            for rule in policy["spec"].get("ingress", []):
                for peer in (p for p in rule.get("from", []) if "podSelector" in p):
                    assert any(selects(peer["podSelector"], pod) for pod in pods.values()), (values, name, peer)
        for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
            assert sum(selects(pdb["spec"]["selector"], pod) for pod in pods.values()) == 1, pdb["metadata"]["name"]


def test_flows_pdserve_needs_are_open_and_others_closed(rendered: dict[str, Objects]) -> None:
    objects = rendered["gpu.yaml"]
    assert {"router", "controller", "ray-head", "prefill", "decode", "redis"} <= set(labels(objects))
    for source in ("router", "controller", "prefill", "decode"):
        assert allowed(objects, source, "prefill", 50061) and allowed(objects, source, "decode", 50061), source
        assert allowed(objects, source, "redis", 6379), source
    assert allowed(objects, "decode", "prefill", 50062) and allowed(objects, "prefill", "decode", 50062)
    assert allowed(objects, "controller", "ray-head", 10001)
    assert not allowed(objects, "router", "prefill", 50062)
    assert not allowed(objects, "router", "ray-head", 10001)
    assert not allowed(objects, "ray-head", "redis", 6379)
    assert not allowed(objects, "router", "controller", 50061)


def test_router_clients_from_values(rendered: dict[str, Objects]) -> None:
    policy = one(rendered["external-redis-tls-monitoring.yaml"], "NetworkPolicy", "pd-pdserve-router")
    grpc_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 50051)
    assert grpc_rule["from"][0] == {"namespaceSelector": {"matchLabels": {"pdserve.io/client": "true"}}}
    objects = rendered["external-redis-tls-monitoring.yaml"]
    assert allowed(objects, "decode", "router", 50051) and allowed(objects, "prefill", "router", 50051)  # drain
    assert allowed(objects, "smoke-test", "router", 50051)  # helm test
    assert allowed(objects, "controller", "router", 50051)  # pdserve status / scale --addr / autoscale
    assert allowed(objects, "decode", "router", 8000) and not allowed(objects, "ray-head", "router", 8000)
    assert not allowed(objects, "ray-head", "router", 50051)
    assert not [o for o in render(sets={"networkPolicy.enabled": "false"}) if o["kind"] == "NetworkPolicy"]


def _env(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in template["spec"]["containers"][0].get("env", [])}


def test_redis_password_from_one_secret(rendered: dict[str, Objects]) -> None:
    for values, secret in (
        ("gpu.yaml", "pd-pdserve-redis"),
        ("external-redis-tls-monitoring.yaml", "pdserve-redis-auth"),
    ):
        objects = rendered[values]
        for component in ("router", "controller", "prefill", "decode"):
            ref = _env(pod_templates(objects)[component])["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": "password"}, (values, component)
    bundled = rendered["gpu.yaml"]
    one(bundled, "Secret", "pd-pdserve-redis")
    redis = pod_templates(bundled)["redis"]
    assert _env(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "pd-pdserve-redis"
    assert "--requirepass" in redis["spec"]["containers"][0]["args"]
    external = rendered["external-redis-tls-monitoring.yaml"]
    assert not [o for o in external if o["kind"] == "StatefulSet"]
    assert (
        "rediss://redis.data.svc.cluster.local:6380/0"
        in pod_templates(external)["router"]["spec"]["containers"][0]["args"]
    )


def test_gcs_fault_tolerance_keeps_the_gcs_tables_in_a_redis_named_for_it() -> None:
    """Off by default. On, it needs a Redis address (never the bundled Redis, which keeps nothing: the GCS stops
    when its Redis comes back empty); the password comes from its own Secret, else the external registry Redis's;
    KubeRay's CRD takes the object; an address with a database is refused (Ray takes host:port only)."""
    assert "gcsFaultToleranceOptions" not in one(render(["gpu.yaml"]), "RayCluster")["spec"]
    on = {"ray.gcsFaultTolerance.enabled": "true"}
    assert "ray.gcsFaultTolerance.redisAddress is required" in render_error(["gpu.yaml"], on)
    address = "rediss://redis.data.svc.cluster.local:6380"
    on["ray.gcsFaultTolerance.redisAddress"] = address

    def options(values: list[str], sets: dict[str, str]) -> dict[str, Any]:
        raycluster = one(render(values, sets), "RayCluster")
        check_raycluster(raycluster)
        return raycluster["spec"]["gcsFaultToleranceOptions"]

    assert options(["gpu.yaml"], on) == {"redisAddress": address}  # not the bundled registry Redis's password
    own = {**on, "ray.gcsFaultTolerance.existingSecret": "gcs-redis", "ray.gcsFaultTolerance.passwordKey": "pw"}
    secret = options(["gpu.yaml"], own)["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "gcs-redis", "key": "pw"}
    shared = options(["external-redis-tls-monitoring.yaml"], on)["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert shared == {"name": "pdserve-redis-auth", "key": "password"}
    assert "redisAddress" in render_error(sets={**on, "ray.gcsFaultTolerance.redisAddress": f"{address}/0"})
    bundled_names = ("pd-pdserve-redis.default.svc.cluster.local:6379", "PD-PDSERVE-REDIS:6379")
    for bundled in (*bundled_names, "rediss://pd-pdserve-redis-0.pd-pdserve-redis-headless:6379"):
        refused = render_error(sets={**on, "ray.gcsFaultTolerance.redisAddress": bundled})
        assert "is the bundled Redis, which keeps nothing" in refused, refused


def test_a_redis_ca_is_mounted_wherever_a_rediss_redis_is_reached() -> None:
    """`redis.caSecret`: every pod that talks to the registry's Redis (router, controller, workers) mounts it and
    names it in PDSERVE_REDIS_CA_CERT; the Ray head too, with RAY_REDIS_CA_CERT, when its GCS keeps its tables in
    Redis; never the smoke test (a client of the router) nor the bundled Redis. Set while no Redis is reached
    over TLS, it is refused."""
    ca = {"redis.caSecret": "redis-ca", "redis.caKey": "bundle.pem"}
    path = "/etc/pdserve/redis-ca/bundle.pem"

    def mounted(templates: dict[str, dict[str, Any]]) -> dict[str, str]:
        """Component -> the variable naming the mounted CA file, of each pod that mounts it."""
        found = {}
        for component, t in templates.items():
            volumes = {v["name"]: v for v in t["spec"].get("volumes", [])}
            mounts = {m["name"]: m for c in t["spec"]["containers"] for m in c.get("volumeMounts", [])}
            if "redis-ca" in volumes:
                secret = volumes["redis-ca"]["secret"]
                assert secret == {"secretName": "redis-ca", "items": [{"key": "bundle.pem", "path": "bundle.pem"}]}
                assert mounts["redis-ca"]["mountPath"] == "/etc/pdserve/redis-ca", component
                (found[component],) = [e for e, v in _env(t).items() if v.get("value") == path]
        return found

    pdserve = dict.fromkeys(["router", "controller", "prefill", "decode"], "PDSERVE_REDIS_CA_CERT")
    assert mounted(pod_templates(render(["external-redis-tls-monitoring.yaml"], ca))) == pdserve
    gcs = {"ray.gcsFaultTolerance.enabled": "true", "ray.gcsFaultTolerance.redisAddress": "rediss://gcs.data:6380"}
    both = render(["external-redis-tls-monitoring.yaml"], {**ca, **gcs})
    check_raycluster(one(both, "RayCluster"))
    assert mounted(pod_templates(both)) == {**pdserve, "ray-head": "RAY_REDIS_CA_CERT"}
    # The bundled registry Redis (plaintext) and a rediss:// GCS Redis: one CA option for both, as the values say.
    assert mounted(pod_templates(render(["gpu.yaml"], {**ca, **gcs}))) == {**pdserve, "ray-head": "RAY_REDIS_CA_CERT"}
    assert "no Redis is reached over TLS" in render_error(["gpu.yaml"], ca)


def test_cluster_secret_and_tls_mounts(rendered: dict[str, Objects]) -> None:
    objects = rendered["external-redis-tls-monitoring.yaml"]
    templates = pod_templates(objects)
    for component in ("router", "controller", "prefill", "decode"):
        ref = _env(templates[component])["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "pdserve-cluster-secret", component
        volumes = {v["name"]: v for v in templates[component]["spec"]["volumes"]}
        assert volumes["tls-internal"]["secret"]["secretName"] == "pdserve-internal-tls", component
    router_args = templates["router"]["spec"]["containers"][0]["args"]
    for option in ("--tls-cert", "--tls-key", "--tls-client-ca", "--internal-tls-cert", "--api-keys"):
        assert option in router_args, option
    worker_public = {v["name"]: v for v in templates["decode"]["spec"]["volumes"]}["tls-public"]["secret"]
    assert worker_public["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the router's key
    assert _env(templates["decode"])["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-drain-key"
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-cluster")]
    assert (
        _env(templates["router"])["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"]
        == "http://otel-collector.observability.svc:4317"
    )
    assert _env(templates["prefill"])["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
    for component in ("router", "controller", "prefill", "decode"):  # a secret never in a pod spec in plain text
        headers = _env(templates[component])["OTEL_EXPORTER_OTLP_HEADERS"]
        assert headers == {"name": "OTEL_EXPORTER_OTLP_HEADERS", "valueFrom": {"secretKeyRef": AUTH_HEADERS}}
    assert "k8s.pod.name=$(POD_NAME)" in _env(templates["prefill"])["OTEL_RESOURCE_ATTRIBUTES"]["value"]
    # The controller may hand its OTEL_* to the actors it starts: no pod name of its own to hand over.
    assert "OTEL_RESOURCE_ATTRIBUTES" not in _env(templates["controller"])
    ray_token = {c for c, t in templates.items() if "RAY_AUTH_TOKEN" in _env(t)}
    assert ray_token == {"controller", "ray-head", "prefill", "decode"}  # not the router, not Redis
    off = pod_templates(render(sets={"ray.authToken.enabled": "false"}))
    modes = {c: _env(t)["RAY_AUTH_MODE"]["value"] for c, t in off.items() if "RAY_AUTH_MODE" in _env(t)}
    assert modes == dict.fromkeys(ray_token, "disabled")  # said, not left to Ray's default


AUTH_HEADERS = {"name": "otel-collector-auth", "key": "headers"}


def test_controller_may_patch_only_its_raycluster_and_list_pods(rendered: dict[str, Objects]) -> None:
    objects = rendered["gpu.yaml"]
    role = one(objects, "Role", "pd-pdserve-controller")
    patch = [r for r in role["rules"] if "patch" in r["verbs"]]
    assert patch == [
        {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "resourceNames": ["pd-pdserve"],
         "verbs": ["get", "patch"]}
    ]  # fmt: skip
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}
    assert [r for r in role["rules"] if r not in patch] == [pods]
    assert one(objects, "RayCluster")["metadata"]["name"] == "pd-pdserve"
    binding = one(objects, "RoleBinding", "pd-pdserve-controller")
    account = pod_templates(objects)["controller"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "serving"}]
    one(objects, "ServiceAccount", account)


@pytest.mark.parametrize(
    ("sets", "account"),
    [
        ({}, "pd-pdserve-controller"),
        ({"nameOverride": "llm"}, "pd-llm-controller"),
        ({"fullnameOverride": "serving"}, "serving-controller"),
        ({"serviceAccount.name": "platform-pdserve"}, "platform-pdserve"),
    ],
)
def test_the_controllers_account_is_never_the_rayclusters(sets: dict[str, str], account: str) -> None:
    """With the autoscaler on, KubeRay gives the head pod an account named after the RayCluster and binds the
    autoscaler's Role to it: an account of the same name would give the controller's token the autoscaler's
    rights and the head the controller's."""
    objects = render(["gpu.yaml"], sets)
    assert one(objects, "RayCluster")["spec"]["enableInTreeAutoscaling"] is True
    one(objects, "ServiceAccount", account)
    assert pod_templates(objects)["controller"]["spec"]["serviceAccountName"] == account
    assert account != one(objects, "RayCluster")["metadata"]["name"]


def test_an_account_named_as_the_raycluster_is_refused() -> None:
    assert "serviceAccount.name must not be" in render_error(sets={"serviceAccount.name": "pd-pdserve"})


def test_the_controllers_role_is_never_bound_to_the_namespaces_default_account() -> None:
    """Without an account of its own (serviceAccount.create=false, no name) the controller runs as `default`,
    whose token any pod of the namespace may mount: the chart refuses to bind its Role to that account."""
    for default in ({"serviceAccount.create": "false"}, {"serviceAccount.name": "default"}):
        refused = render_error(sets=default)
        assert "set serviceAccount.name" in refused, refused
    own = render(sets={"serviceAccount.create": "false", "serviceAccount.name": "pdserve-ops"})
    assert not [o for o in own if o["kind"] == "ServiceAccount"]
    assert one(own, "RoleBinding")["subjects"][0]["name"] == "pdserve-ops"
    no_rbac = render(sets={"serviceAccount.create": "false", "rbac.create": "false"})
    assert not [o for o in no_rbac if o["kind"] in ("Role", "RoleBinding")]


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_a_router_exposed_outside_the_cluster_needs_api_keys_client_certificates_or_an_explicit_opt_in(
    service_type: str,
) -> None:
    """Without API keys or client certificates anyone reaching the router may send requests and call its Admin
    service (drain, scale)."""
    exposed = {"router.service.type": service_type}
    assert "router.service.allowUnauthenticated=true to expose it open" in render_error(sets=exposed)
    keys = {"apiKeys.existingSecret": "keys", "apiKeys.drainKey.existingSecret": "drain-key"}
    tls = {"tls.enabled": "true", "tls.publicSecret": "pub", "tls.internalSecret": "int"}
    assert "allowUnauthenticated" in render_error(sets={**exposed, **tls})  # TLS alone authenticates nobody
    certs = {**tls, "tls.clientCASecret": "client-ca"}
    for sets in ({**exposed, **keys}, {**exposed, **certs}, {**exposed, "router.service.allowUnauthenticated": "true"}):
        assert one(render(sets=sets), "Service", "pd-pdserve-router")["spec"]["type"] == service_type


def test_ray_open_to_the_whole_cluster_needs_an_explicit_opt_in() -> None:
    """No Ray token and no NetworkPolicy: any pod in the cluster may reach the Ray Client port and run code."""
    open_ray = {"ray.authToken.enabled": "false", "networkPolicy.enabled": "false"}
    assert "set ray.authToken.allowUnauthenticated=true" in render_error(sets=open_ray)
    render(sets={**open_ray, "ray.authToken.allowUnauthenticated": "true"})
    for one_guard in ({"ray.authToken.enabled": "false"}, {"networkPolicy.enabled": "false"}):
        render(sets=one_guard)


def test_monitors_select_the_metrics_ports(rendered: dict[str, Objects]) -> None:
    assert not [o for o in rendered["gpu.yaml"] if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    objects = rendered["external-redis-tls-monitoring.yaml"]
    service_monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service", "pd-pdserve-router-metrics")
    assert selects(service_monitor["spec"]["selector"], service["metadata"]["labels"])
    public = one(objects, "Service", "pd-pdserve-router")
    assert not selects(service_monitor["spec"]["selector"], public["metadata"]["labels"])
    assert service_monitor["metadata"]["labels"]["release"] == "prometheus"
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    pods = labels(objects)
    # Ray's own metrics need ray[default]: not shipped
    monitors = {"pd-pdserve-workers": {"prefill", "decode"}, "pd-pdserve-controller": {"controller"}}
    for name, components in monitors.items():
        pod_monitor = one(objects, "PodMonitor", name)
        assert {c for c, pod in pods.items() if selects(pod_monitor["spec"]["selector"], pod)} == components
        port = pod_monitor["spec"]["podMetricsEndpoints"][0]["port"]
        for component in components:
            ports = pod_templates(objects)[component]["spec"]["containers"][0]["ports"]
            assert port in {p["name"] for p in ports}, (name, component)
    # The workers' series carry `role` themselves: the scrape's own `role` (for process metrics) must not rename it.
    workers = one(objects, "PodMonitor", "pd-pdserve-workers")["spec"]["podMetricsEndpoints"][0]
    assert workers["honorLabels"] is True and workers["relabelings"][0]["targetLabel"] == "role"
    # metricsFrom names the monitoring namespace only
    assert not allowed(objects, "router", "decode", 9401) and not allowed(objects, "router", "controller", 9402)
    assert allowed(rendered["gpu.yaml"], "router", "controller", 9402)  # no metricsFrom: any scraper


def test_the_routers_metrics_stay_off_its_public_service() -> None:
    """A LoadBalancer router Service publishes what it carries; the metrics (no key check, per-tenant labels)
    are on a ClusterIP Service of their own, which selects the same router pods."""
    objects = render(["external-redis-tls-monitoring.yaml"], {"router.service.type": "LoadBalancer"})  # API keys
    public, metrics = one(objects, "Service", "pd-pdserve-router"), one(objects, "Service", "pd-pdserve-router-metrics")
    assert public["spec"]["type"] == "LoadBalancer" and "metrics" not in {p["name"] for p in public["spec"]["ports"]}
    assert metrics["spec"]["type"] == "ClusterIP" and [p["name"] for p in metrics["spec"]["ports"]] == ["metrics"]
    assert metrics["spec"]["selector"] == public["spec"]["selector"]
