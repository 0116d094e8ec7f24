"""The values the issue names each change what is rendered; values.schema.json (and the templates' own
checks) refuse bad values with a message naming the field."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

import jsonschema
import pytest
import yaml

from pdserve.config import MAX_WORKERS_PER_ROLE, ClusterConfig, RouterConfig
from pdserve.protocol.request_checks import RequestLimits
from tests.deploy.chart import CHART, one, pod_templates, render, render_error

Objects = list[dict[str, Any]]
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)


def args(objects: Objects, component: str) -> list[str]:
    return pod_templates(objects)[component]["spec"]["containers"][0]["args"]


def flag(objects: Objects, component: str, name: str) -> str:
    a = args(objects, component)
    return a[a.index(name) + 1]


def group(objects: Objects, role: str) -> dict[str, Any]:
    return next(g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"] if g["groupName"] == role)


def kinds(objects: Objects) -> set[str]:
    return {o["kind"] for o in objects}


# (value name, what to set, how the rendered objects show it)
REQUIRED: list[tuple[str, dict[str, Any], Any]] = [
    ("model.name", {"model.name": "my-llama"},
     lambda o: all("my-llama" in args(o, c) for c in ("router", "controller"))
     and group(o, "decode")["template"]["spec"]["initContainers"][0]["args"][-1] == "my-llama"),
    ("router.replicas", {"router.replicas": "5"},
     lambda o: one(o, "Deployment", "pd-pdserve-router")["spec"]["replicas"] == 5),
    ("prefill.replicas", {"prefill.replicas": "3"},
     lambda o: group(o, "prefill")["replicas"] == 3 and flag(o, "controller", "--prefill") == "3"),
    ("decode.replicas", {"decode.replicas": "4"},
     lambda o: group(o, "decode")["replicas"] == 4 and flag(o, "controller", "--decode") == "4"),
    ("prefill.resources", {"prefill.resources": {"requests": {"cpu": "3"}, "limits": {"memory": "7Gi"}}},
     lambda o: group(o, "prefill")["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "7Gi"),
    ("decode.resources", {"decode.resources": {"requests": {"cpu": "5"}, "limits": {"memory": "9Gi"}}},
     lambda o: group(o, "decode")["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "5"),
    ("redis.enabled", {"redis.enabled": "false", "redis.url": "redis://elsewhere:6379/0"},
     lambda o: "StatefulSet" not in kinds(o)),
    ("redis.url", {"redis.enabled": "false", "redis.url": "redis://elsewhere:6379/0"},
     lambda o: "redis://elsewhere:6379/0" in args(o, "router") and "redis://elsewhere:6379/0" in args(o, "controller")),
    ("monitoring.serviceMonitor.enabled", {"monitoring.serviceMonitor.enabled": "true"},
     lambda o: "ServiceMonitor" in kinds(o)),
    ("monitoring.grafanaDashboard.enabled",
     {"monitoring.grafanaDashboard.enabled": "true", "monitoring.podMonitor.enabled": "true"},
     lambda o: any(c["metadata"]["labels"].get("grafana_dashboard") == "1" for c in o if c["kind"] == "ConfigMap")),
    ("networkPolicy.enabled", {"networkPolicy.enabled": "false"}, lambda o: "NetworkPolicy" not in kinds(o)),
    ("tls.enabled", {"tls.enabled": "true", "tls.publicSecret": "pub", "tls.internalSecret": "int"},
     lambda o: "--tls-cert" in args(o, "router") and "--internal-tls-ca" in args(o, "controller")),
]  # fmt: skip


@cache
def default_render() -> Objects:
    return render()


@cache
def everything_set_render() -> Objects:
    """One render with every REQUIRED setting at once (they do not conflict): one helm run, not eleven."""
    return render(sets={k: v for _, sets, _ in REQUIRED for k, v in sets.items()})


@pytest.mark.parametrize(("name", "sets", "shows"), REQUIRED, ids=[r[0] for r in REQUIRED])
def test_required_value_changes_the_render(name: str, sets: dict[str, Any], shows: Any) -> None:
    assert not shows(default_render()), f"{name}: the default render already shows it, so the check proves nothing"
    assert shows(everything_set_render()), name


def test_every_required_value_is_in_the_schema() -> None:
    for name, _, _ in REQUIRED:
        node = SCHEMA
        for part in name.split("."):
            node = node["properties"][part]
        assert node, name


BAD: list[tuple[dict[str, Any], str]] = [
    ({"prefill.replicas": "-1"}, "prefill/replicas"),
    # The controller runs 1 to 64 workers per role and refuses other counts at start (a crash loop).
    ({"prefill.replicas": "0", "prefill.minReplicas": "0"}, "prefill/replicas"),
    ({"decode.replicas": "100", "decode.maxReplicas": "100"}, "decode/replicas"),
    ({"decode.maxReplicas": "65"}, "decode/maxReplicas"),
    ({"prefill.minReplicas": "0"}, "prefill/minReplicas"),
    ({"router.replicas": "0"}, "router/replicas"),
    ({"router.config.max_inflight": "10"}, "max_inflight"),  # a typo: the router would not start
    ({"router.config.request_limits.max_stop": "0"}, "max_stop"),  # the router refuses it at start
    ({"router.config.default_max_tokens": "0"}, "default_max_tokens"),
    ({"router.config.stall_timeout_s": "1"}, "stall_timeout_s"),  # under 2 s the router refuses it at start
    ({"prefill.gpus": "2"}, "prefill/gpus"),  # one worker per pod: the second GPU would idle
    ({"model.name": ""}, "model/name"),
    ({"redis.enabled": "false"}, "redis/url"),
    ({"redis.url": "http://redis:6379"}, "redis/url"),
    # A password in the URL would sit in every pod's arguments: redis.existingSecret holds it.
    ({"redis.url": "redis://:hunter2@r:6379/0"}, "redis/url"),
    ({"redis.url": "rediss://app:hunter2@r:6380/0"}, "redis/url"),
    ({"redis.url": "redis://r:6379/0?password=hunter2"}, "redis/url"),
    ({"tls.enabled": "true"}, "tls"),
    ({"networkPolicy.enabled": "yes please"}, "networkPolicy/enabled"),
    ({"workers.port": "70000"}, "workers/port"),
    ({"prefil.replicas": "1"}, "prefil"),
    ({"decode.resources": {"limits": {"memory": "lots"}}}, "decode/resources/limits/memory"),
    ({"tmp.sizeLimit": "lots"}, "tmp/sizeLimit"),  # every pod's /tmp emptyDir: the API server would refuse each
    ({"router.config.policy": "random"}, "router/config/policy"),
    ({"router.config.slo_headroom": "0.7"}, "router/config/slo_headroom"),  # --set makes it a string
    # An origin no browser sends so would never match; the router refuses it at start.
    ({"router.httpCors.origins": ["https://chat.example.com/app"]}, "router/httpCors/origins/0"),
    ({"router.httpCors.origins": ["HTTPS://Chat.example.com"]}, "router/httpCors/origins/0"),
    ({"router.httpCors.origins": ["https://a.*.example.com"]}, "router/httpCors/origins/0"),
    ({"engine.device": "tpu"}, "engine/device"),
    ({"router.autoscaling.targetCPUUtilizationPercentage": "150"}, "router/autoscaling/targetCPUUtilizationPercentage"),
    ({"router.autoscaling.maxReplicas": "0"}, "router/autoscaling/maxReplicas"),
    ({"router.terminationGracePeriodSeconds": "10"}, "router/terminationGracePeriodSeconds"),  # no time to drain
    # Names that went unquoted into flow mappings (a YAML parse error) or into the preStop's shell script.
    ({"clusterSecret.existingSecret": "a}b"}, "clusterSecret/existingSecret"),
    ({"model.cache.existingClaim": "models, readOnly: true"}, "model/cache/existingClaim"),
    ({"tls.serverName": "x;touch${IFS}/tmp/pwn"}, "tls/serverName"),
    ({"tls.internalServerName": "a b"}, "tls/internalServerName"),
    ({"redis.passwordKey": "pass word"}, "redis/passwordKey"),
    ({"apiKeys.drainKey.existingSecret": "Drain_Key"}, "apiKeys/drainKey/existingSecret"),
    # Names the API server refuses in a ConfigMap's labels and annotations (the Grafana dashboard's).
    ({"monitoring.grafanaDashboard.label": "grafana dashboard"}, "monitoring/grafanaDashboard/label"),
    ({"monitoring.grafanaDashboard.labelValue": "-1"}, "monitoring/grafanaDashboard/labelValue"),
    ({"monitoring.grafanaDashboard.labelValue": "x" * 64}, "monitoring/grafanaDashboard/labelValue"),
    ({"monitoring.grafanaDashboard.labelValue": "true"}, "monitoring/grafanaDashboard/labelValue"),
    ({"monitoring.grafanaDashboard.folderAnnotation": "Grafana.Folder/x"}, "grafanaDashboard/folderAnnotation"),
]


def _merged(base: Any, override: Any) -> Any:
    """Helm's coalescing of a values override into the chart's values.yaml: maps merge, the rest replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in override.items()}}
    return override


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    """--set's meaning: "3" is a number, "true"/"false" booleans, anything else a string; non-str is JSON."""
    if isinstance(value, str):
        value = yaml.safe_load(value) if value in ("true", "false") or value.lstrip("-").isdigit() else value
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize(("sets", "named"), BAD, ids=[next(iter(b[0])) for b in BAD])
def test_schema_refuses_bad_values_naming_the_field(sets: dict[str, Any], named: str) -> None:
    """Checked in-process against values.schema.json (as helm does, after merging into the defaults): fast."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in sets.items():
        values = _merged(values, _nested(key, value))
    errors = list(VALIDATOR.iter_errors(values))
    assert errors, f"accepted: {sets}"
    where = {"/".join(map(str, e.absolute_path)) or e.message for e in errors}
    assert any(named in w or named in e.message for w in where for e in errors), where


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        ({"prefil.replicas": "1"}, "additional properties 'prefil' not allowed"),
        # Only OTEL_* variables: refused naming the map (helm's message for a propertyNames failure named a random
        # other value's path).
        ({"otel.env": {"SERVICE_NAME": "x"}}, "at '/otel/env': additional properties 'SERVICE_NAME' not allowed"),
        (
            {"otel.secretEnv": {"HEADERS": {"name": "otel-auth", "key": "headers"}}},
            "at '/otel/secretEnv': additional properties 'HEADERS' not allowed",
        ),
        ({"redis.enabled": "false"}, "/redis/url"),
        ({"clusterSecret.existingSecret": "a}b"}, "/clusterSecret/existingSecret"),
        ({"tls.serverName": "x;touch${IFS}/tmp/pwn"}, "/tls/serverName"),
        ({"prefill.replicas": "0", "prefill.minReplicas": "0"}, "/prefill/replicas"),
        (
            {"decode.replicas": "9"},
            "decode.replicas (9) must lie between decode.minReplicas (1) and decode.maxReplicas (8)",
        ),
        (
            {"router.autoscaling.enabled": "true", "router.autoscaling.minReplicas": "9"},
            "router.autoscaling.minReplicas (9) must not exceed router.autoscaling.maxReplicas (8)",
        ),
        (
            {"router.autoscaling.enabled": "true", "router.resources.requests.cpu": "null"},
            "router.autoscaling needs router.resources.requests.cpu",
        ),
        # Or every drain is refused; and a drain-only key, as every worker pod holds it.
        (
            {"apiKeys.existingSecret": "keys"},
            "set apiKeys.drainKey.existingSecret too (a Secret holding a drain-only key: its entry in the key file"
            ' says admin = ["DrainWorkers"]',
        ),
        ({"decode.gpus": "0"}, "prefill.gpus (1) and decode.gpus (0) must be equal"),  # decode actors never placed
        # A value the chart would silently ignore: the bundled Redis's URL went to every pod, TLS stayed off.
        (
            {"redis.url": "rediss://ext:6380/0"},
            "redis.url (rediss://ext:6380/0) is set, but redis.enabled is true: the chart would run its bundled Redis",
        ),
        ({"tls.publicSecret": "pub"}, "tls.publicSecret (pub) is set, but tls.enabled is false"),
        ({"tls.clientCASecret": "ca"}, "tls.clientCASecret (ca) is set, but tls.enabled is false"),
        ({"tls.internalSecret": "int"}, "Set tls.enabled=true (with tls.publicSecret and tls.internalSecret)"),
        ({"router.httpPort": "50051"}, "router.port (50051), router.httpPort (50051) and router.metricsPort (9400)"),
        # What the router refuses at start (a crash loop), or a value the chart would send to no HTTP API.
        (
            {"router.httpCors.origins": ["*"], "router.httpCors.allowCredentials": "true"},
            'router.httpCors.origins "*" cannot go with router.httpCors.allowCredentials',
        ),
        (
            {"router.httpCors.allowCredentials": "true"},
            "router.httpCors.allowCredentials needs router.httpCors.origins",
        ),
        (
            {"router.httpCors.origins": ["https://a.example"], "router.httpPort": "0"},
            "router.httpCors.origins needs router.httpPort",
        ),
        # A worker pod binds its gRPC and metrics ports, and a decode worker a KV rendezvous store per prefill peer
        # from workers.transferPort on.
        ({"workers.transferPort": "50061"}, "workers.port (50061) lies in the KV-transfer ports 50061-50068"),
        ({"workers.metricsPort": "50061"}, "workers.port (50061) and workers.metricsPort (50061) must differ"),
        ({"workers.metricsPort": "50069"}, "workers.metricsPort (50069) lies in the KV-transfer ports 50062-50069"),
        (
            {"workers.port": "50075", "prefill.maxReplicas": "16"},
            "workers.port (50075) lies in the KV-transfer ports 50062-50077",
        ),
        # Keys the chart sets itself: rendered twice, the last would win (the role resource lost: no worker actor
        # placed; or actors on the head).
        ({"prefill.rayStartParams.resources": "x"}, "prefill.rayStartParams.resources is set by the chart"),
        ({"ray.head.rayStartParams.num-cpus": "0.5"}, "ray.head.rayStartParams.num-cpus is set by the chart"),
        # The head's ports its probes, Service and the controller's Ray address are rendered with.
        ({"ray.head.rayStartParams": {"port": "6380"}}, "ray.head.rayStartParams.port is set by the chart"),
        # Names the API server refuses only at install, each object then failing alone: not a DNS label (the chart's
        # name, within every object's), a DNS-1035 label (the prefix of every Service's) or a DNS subdomain.
        ({"nameOverride": "My_App"}, "at '/nameOverride'"),
        ({"fullnameOverride": "1pd"}, "at '/fullnameOverride'"),
        ({"serviceAccount.name": "Controller_Account"}, "at '/serviceAccount/name'"),
        ({"prefill.runtimeClassName": "NVIDIA"}, "at '/prefill/runtimeClassName'"),
        ({"decode.priorityClassName": "gpu serving"}, "at '/decode/priorityClassName'"),
        ({"router.priorityClassName": "high_priority"}, "at '/router/priorityClassName'"),
        # A budget of no pod refused every eviction: no node holding a router could ever be drained.
        ({"router.pdb.maxUnavailable": "0"}, "at '/router/pdb/maxUnavailable'"),
        ({"router.pdb.maxUnavailable": "0%"}, "at '/router/pdb/maxUnavailable'"),
        # Not a Prometheus duration: prometheus-operator's CRD refuses the monitor; empty rendered `interval:` null.
        (
            {"monitoring.serviceMonitor.enabled": "true", "monitoring.serviceMonitor.interval": "15 seconds"},
            "at '/monitoring/serviceMonitor/interval'",
        ),
        ({"monitoring.serviceMonitor.interval": ""}, "at '/monitoring/serviceMonitor/interval'"),
        ({"monitoring.podMonitor.interval": "1m30"}, "at '/monitoring/podMonitor/interval'"),
        (
            {"ray.head.rayStartParams": {"ray-client-server-port": "10002"}},
            "ray.head.rayStartParams.ray-client-server-port is set by the chart",
        ),
    ],
)
def test_helm_refuses_bad_values(sets: dict[str, Any], named: str) -> None:
    """helm itself enforces the schema and the templates' range check."""
    assert named in render_error(sets=sets)


@pytest.mark.parametrize(
    "url", ["redis://r:6379/0", "rediss://redis.data.svc:6380/0?ssl_cert_reqs=required", "redis://app@[::1]:6379"]
)
def test_a_redis_url_without_a_password_is_taken(url: str) -> None:
    """A user name alone may stay in the URL (the password then comes from redis.existingSecret)."""
    values = _merged(yaml.safe_load((CHART / "values.yaml").read_text()), {"redis": {"enabled": False, "url": url}})
    assert not list(VALIDATOR.iter_errors(values))


def test_names_and_durations_kubernetes_and_prometheus_take_are_taken() -> None:
    """The patterns refuse no name the API server takes, nor a duration prometheus-operator takes."""
    taken = {
        "nameOverride": "llm-2",
        "fullnameOverride": "pd",
        "serviceAccount": {"name": "pd.controller"},
        "prefill": {"runtimeClassName": "nvidia", "priorityClassName": "system-cluster-critical"},
        "decode": {"priorityClassName": "gpu.serving"},
        "monitoring": {
            "serviceMonitor": {"interval": "1m30s"},
            "podMonitor": {"interval": "500ms"},
            "grafanaDashboard": {"label": "grafana.example.com/dashboard", "labelValue": "", "folder": "LLM / pdserve"},
        },
    }
    assert not list(VALIDATOR.iter_errors(_merged(yaml.safe_load((CHART / "values.yaml").read_text()), taken)))


@pytest.mark.parametrize("max_unavailable", [1, 3, "1%", "50%", "100%"])
def test_a_router_budget_that_lets_a_drain_through_is_taken(max_unavailable: int | str) -> None:
    """A percentage is rounded up (at least one pod may go), so only 0 and 0% refuse every eviction."""
    budget = _nested("router.pdb.maxUnavailable", max_unavailable)
    assert not list(VALIDATOR.iter_errors(_merged(yaml.safe_load((CHART / "values.yaml").read_text()), budget)))


def test_names_from_values_render_as_the_strings_they_are() -> None:
    """Secret, claim and key names sit in flow mappings, where YAML would read a bare 0x1f as the number 31: each
    is quoted, so the pods name exactly the objects the values do (a Kubernetes name may look like a number)."""
    names = {
        "clusterSecret.existingSecret": "0x1a",
        "ray.authToken.existingSecret": "0x1b",
        "redis.existingSecret": "0x1c",
        "redis.passwordKey": "0x1d",
        "model.cache.existingClaim": "0x1e",
        "apiKeys.existingSecret": "0x2a",
        "apiKeys.drainKey.existingSecret": "0x2b",
        "apiKeys.drainKey.key": "0x2c",
        "tls.enabled": "true",
        "tls.publicSecret": "0x3a",
        "tls.internalSecret": "0x3b",
        "tls.clientCASecret": "0x3c",
        "tls.serverName": "0x3d",
    }
    objects = render(sets=names)
    decode = pod_templates(objects)["decode"]["spec"]
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in decode["containers"][0]["env"]}
    assert env["PDSERVE_CLUSTER_SECRET"] == {"name": "0x1a", "key": "secret"}
    assert env["RAY_AUTH_TOKEN"] == {"name": "0x1b", "key": "token"}
    assert env["PDSERVE_REDIS_PASSWORD"] == {"name": "0x1c", "key": "0x1d"}
    assert env["PDSERVE_API_KEY"] == {"name": "0x2b", "key": "0x2c"}
    volumes = {v["name"]: v for v in decode["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "0x1e"}
    assert (volumes["tls-internal"]["secret"]["secretName"], volumes["tls-public"]["secret"]["secretName"]) == (
        "0x3b",
        "0x3a",
    )
    router = {v["name"]: v for v in pod_templates(objects)["router"]["spec"]["volumes"]}
    assert [router[n]["secret"]["secretName"] for n in ("api-keys", "tls-client-ca")] == ["0x2a", "0x3c"]
    probe = pod_templates(objects)["router"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[probe.index("--server-name") + 1] == "0x3d"
    redis = pod_templates(render(sets={"redis.passwordKey": "0x1d"}))["redis"]["spec"]["containers"][0]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "pd-pdserve-redis", "key": "0x1d"}
    assert "0x1d" in one(render(sets={"redis.passwordKey": "0x1d"}), "Secret", "pd-pdserve-redis")["data"]


def test_worker_ports_just_past_the_kv_transfer_ports_render() -> None:
    """The transfer ports are one per prefill peer: workers.transferPort up to prefill.maxReplicas - 1 past it."""
    objects = render(sets={"workers.port": "50070", "workers.metricsPort": "50061"})
    assert (flag(objects, "controller", "--worker-port"), flag(objects, "controller", "--transfer-port")) == (
        "50070",
        "50062",
    )


def test_worker_counts_are_the_ones_the_controller_takes() -> None:
    """replicas and its bounds lie in 1..MAX_WORKERS_PER_ROLE, the counts the controller starts with."""
    for role in ("prefill", "decode"):
        for name in ("replicas", "minReplicas", "maxReplicas"):
            node = SCHEMA["properties"][role]["properties"][name]
            assert (node["minimum"], node["maximum"]) == (1, MAX_WORKERS_PER_ROLE), (role, name)
    ClusterConfig(prefill=MAX_WORKERS_PER_ROLE, decode=1)
    with pytest.raises(ValueError, match="1 to 64"):
        ClusterConfig(prefill=MAX_WORKERS_PER_ROLE + 1, decode=1)


def test_router_config_takes_every_setting_the_router_reads_and_no_other() -> None:
    """A key the router does not know would stop it at start (pdserve.config), so the schema refuses it first; the
    chart sets TLS, API keys, reflection and CORS by flags, and heartbeat_s is the controller's."""
    config = SCHEMA["properties"]["router"]["properties"]["config"]
    by_chart = {"api_keys_file", "tls_cert", "tls_key", "tls_client_ca", "reflection", "heartbeat_s"}
    by_chart |= {"http_cors_origins", "http_cors_allow_credentials"}  # router.httpCors
    assert set(config["properties"]) == {f.name for f in dataclasses.fields(RouterConfig)} - by_chart
    assert config["additionalProperties"] is False
    limits = config["properties"]["request_limits"]
    assert set(limits["properties"]) == {f.name for f in dataclasses.fields(RequestLimits)}
