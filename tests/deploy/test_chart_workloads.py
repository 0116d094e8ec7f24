"""What the rendered workloads carry: GPUs and Ray resources per worker group, probes on the ports that
serve them, the drain before a worker pod stops, the controller's contract flags, the router's TOML."""

from __future__ import annotations

import importlib.util
import json
import shlex
from typing import Any

import pytest
from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources as custom_resources

from pdserve import cli
from pdserve.build import build_resource
from pdserve.config import ClusterConfig, RouterConfig
from pdserve.flags import flag_values
from tests.deploy.chart import (
    Objects,
    container,
    notes,
    one,
    pod_templates,
    render,
    render_error,
    worker_groups,
)

ROUTER = "pd-pdserve-router"


def args_of(objects: Objects, name: str) -> list[str]:
    return container(one(objects, "Deployment", name)["spec"]["template"])["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_one_gpu_per_worker_pod_on_gpu_and_none_on_cpu(rendered: dict[str, Objects]) -> None:
    for role, group in worker_groups(rendered["gpu.yaml"]).items():
        resources = container(group["template"])["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 1, role
        assert resources["requests"]["nvidia.com/gpu"] == 1, role
        assert group["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"], role
        assert any(t["key"] == "nvidia.com/gpu" for t in group["template"]["spec"]["tolerations"]), role
    assert "nvidia.com/gpu" not in json.dumps(rendered["cpu-small.yaml"])


def test_each_worker_group_offers_its_role_resource_and_its_images(rendered: dict[str, Objects]) -> None:
    """`--role-resources` actors ask for {"pdserve_<role>": 1}: each pod of a group hosts one of its role; and
    `--build-resources` ones for a sliver of their build's, which only pods of that image offer."""
    objects = rendered["gpu.yaml"]
    groups = worker_groups(objects)
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        # KubeRay pastes the value into a shell command line: the shell's word is the JSON. KubeRay also reads it
        # itself (to add --num-gpus) once it trims the quotes around it (pod.go getResourcesMap).
        value = group["rayStartParams"]["resources"]
        (word,) = shlex.split(value)
        assert json.loads(value.strip("'\"` ")) == json.loads(word)
        assert custom_resources({}, group["rayStartParams"], role) == json.loads(word)  # and Ray's autoscaler
        image = container(group["template"])["image"]
        (build,) = [e["value"] for e in container(group["template"])["env"] if e["name"] == "PDSERVE_BUILD"]
        assert build.startswith(f"{image} pods.")  # the image, and a digest of what its pods are made of
        assert json.loads(word) == {f"pdserve_{role}": 1, build_resource(build): 1}
        assert group["minReplicas"] <= group["replicas"] == 2 <= group["maxReplicas"]
    args = args_of(objects, "pd-pdserve-controller")
    assert "--role-resources" in args
    assert (flag(args, "--prefill"), flag(args, "--decode")) == ("2", "2")
    assert flag(args, "--ray-address") == "ray://pd-pdserve-head-svc:10001"
    head = container(one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"])
    assert {"name": "client", "containerPort": 10001, "protocol": "TCP"} in head["ports"]
    assert (flag(args, "--worker-port"), flag(args, "--transfer-port")) == ("50061", "50062")
    controller = pod_templates(objects)["controller"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": int(flag(args, "--metrics-port")), "protocol": "TCP"} in controller[
        "ports"
    ]


def test_shm_and_model_cache_on_worker_pods(rendered: dict[str, Objects]) -> None:
    for values, claim in (("gpu.yaml", "pd-pdserve-models"), ("cpu-small.yaml", None)):
        for role, group in worker_groups(rendered[values]).items():
            spec = group["template"]["spec"]
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["shm"]["emptyDir"]["medium"] == "Memory", role
            cache = volumes["model-cache"]
            assert (cache.get("persistentVolumeClaim") or {}).get("claimName") == claim, (values, role)
            (init,) = spec["initContainers"]
            assert init["args"][:2] == ["fetch", "--model"]
            mounts = {m["name"]: m["mountPath"] for m in container(group["template"])["volumeMounts"]}
            assert mounts["shm"] == "/dev/shm" and mounts["model-cache"] == "/models"
    one(rendered["gpu.yaml"], "PersistentVolumeClaim", "pd-pdserve-models")


def _probe_ports(c: dict[str, Any]) -> set[int]:
    ports = set()
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        if "grpc" in probe:
            ports.add(probe["grpc"]["port"])
        else:  # TLS: pdserve's own health probe, which can present certificates
            command = probe["exec"]["command"]
            assert command[:3] == ["python", "-m", "pdserve.rpc.health_probe"]
            ports.add(int(flag(command, "--addr").rsplit(":", 1)[1]))
    return ports


@pytest.mark.parametrize("values", ["gpu.yaml", "external-redis-tls-monitoring.yaml"])
def test_health_probes_on_the_grpc_ports(rendered: dict[str, Objects], values: str) -> None:
    objects = rendered[values]
    router = container(one(objects, "Deployment", ROUTER)["spec"]["template"])
    router_port = next(p["containerPort"] for p in router["ports"] if p["name"] == "grpc")
    assert _probe_ports(router) == {router_port} == {int(flag(router["args"], "--port"))}
    service = one(objects, "Service", ROUTER)
    assert {"name": "grpc", "port": router_port, "targetPort": "grpc"}.items() <= service["spec"]["ports"][0].items()
    for role, group in worker_groups(objects).items():
        worker = container(group["template"])
        grpc_port = next(p["containerPort"] for p in worker["ports"] if p["name"] == "grpc")
        assert _probe_ports(worker) == {grpc_port} == {50061}, role


def test_tls_probes_present_the_pods_certificates(rendered: dict[str, Objects]) -> None:
    objects = rendered["external-redis-tls-monitoring.yaml"]
    worker = container(worker_groups(objects)["decode"]["template"])
    command = worker["readinessProbe"]["exec"]["command"]
    mounts = {m["mountPath"] for m in worker["volumeMounts"]}
    for option in ("--tls-ca", "--tls-cert", "--tls-key"):
        assert flag(command, option).rsplit("/", 1)[0] in mounts
    assert importlib.util.find_spec(command[2]) is not None  # the module the image runs exists


@pytest.mark.parametrize("timeout", [60, 300])
def test_prestop_drains_within_the_grace_period(timeout: int) -> None:
    objects = render(["gpu.yaml"], {"drain.timeoutSeconds": str(timeout)})
    for role, group in worker_groups(objects).items():
        spec = group["template"]["spec"]
        script = container(group["template"])["lifecycle"]["preStop"]["exec"]["command"][-1]
        ray_drain, pdserve_drain = script.splitlines()
        ray_argv = shlex.split(ray_drain)  # bounded: a GCS that does not answer must not take the drain's time
        assert ray_argv[:4] == ["timeout", "10", "ray", "drain-node"] and ray_drain.endswith("|| true"), script
        assert f"--deadline-remaining-seconds {timeout + 20}" in ray_drain
        drain = shlex.split(pdserve_drain)
        assert drain[:2] == ["pdserve", "drain"], script
        assert flag(drain, "--addr") == f"{ROUTER}:50051"
        assert flag(drain, "--host") == "$POD_IP"  # shlex keeps it; /bin/sh expands it
        assert int(flag(drain, "--timeout")) == timeout
        assert spec["terminationGracePeriodSeconds"] >= int(ray_argv[1]) + timeout + 10, role
        liveness = container(group["template"])["livenessProbe"]  # NOT_SERVING while draining: outlast it
        assert liveness["failureThreshold"] * liveness["periodSeconds"] > timeout, role
        env = {e["name"] for e in container(group["template"])["env"]}
        assert "POD_IP" in env
    # A SIGTERM without the preStop (an eviction, a failed hook) drains as long.
    assert float(flag(args_of(objects, "pd-pdserve-controller"), "--worker-drain-timeout-s")) == timeout
    # A rollout's surge waits for a new pod, which takes minutes, not the flag's default minute.
    assert float(flag(args_of(objects, "pd-pdserve-controller"), "--rollout-surge-wait-s")) == 300


def _window(probe: dict[str, Any]) -> int:
    return probe["failureThreshold"] * probe["periodSeconds"]


@pytest.mark.parametrize("startup", [30, 90, 180])
def test_liveness_outlasts_a_model_reload_as_long_as_the_first_load(startup: int) -> None:
    """Ray restarts a dead worker actor inside its running pod (max_restarts): the new process reloads the model
    (its port closed, then NOT_SERVING) under the liveness probe alone. Liveness must give that at least the
    startup probe's window, or the kubelet restarts the whole Ray node mid-reload; a longer one set stays."""
    sets = {"workers.probes.startupFailureThreshold": str(startup), "workers.probes.livenessFailureThreshold": "3"}
    for role, group in worker_groups(render(["gpu.yaml"], sets)).items():
        probes = container(group["template"])
        assert probes["startupProbe"]["failureThreshold"] == startup, role
        assert _window(probes["livenessProbe"]) > _window(probes["startupProbe"]), role
    longer = render(["gpu.yaml"], {"workers.probes.livenessFailureThreshold": "100"})
    assert container(worker_groups(longer)["decode"]["template"])["livenessProbe"]["failureThreshold"] == 100


@pytest.mark.parametrize(("floor", "budget"), [(1, None), (2, 1), (3, 2)])
def test_a_worker_groups_budget_keeps_its_scaling_floor_not_its_install_count(floor: int, budget: int | None) -> None:
    """The autoscaler or the planner may take a group down to minReplicas whatever replicas the install set: at
    that floor the budget must still let one pod go (a node drain), and a floor of one pod gets no budget."""
    sets = {"decode.minReplicas": str(floor), "decode.replicas": "4", "decode.maxReplicas": "8"}
    sets["prefill.minReplicas"] = "1"
    budgets = {o["metadata"]["name"]: o for o in render(["gpu.yaml"], sets) if o["kind"] == "PodDisruptionBudget"}
    assert "pd-pdserve-prefill" not in budgets  # 2 pods at install, but a floor of 1
    if budget is None:
        assert "pd-pdserve-decode" not in budgets
        return
    min_available = budgets["pd-pdserve-decode"]["spec"]["minAvailable"]
    assert min_available == budget
    assert floor - min_available == 1  # disruptions allowed with the group at its floor


def test_the_gpu_example_keeps_two_pods_per_role_through_node_drains() -> None:
    """Its floor of two per role (the autoscaler and the planner never go below it) leaves each a budget: a node
    drain, or a surge upgrade of the node pool, takes at most one pod of a role at a time."""
    budgets = {o["metadata"]["name"]: o["spec"] for o in render(["gpu.yaml"]) if o["kind"] == "PodDisruptionBudget"}
    assert budgets["pd-pdserve-prefill"]["minAvailable"] == budgets["pd-pdserve-decode"]["minAvailable"] == 1


def test_the_ray_head_is_never_evicted_while_its_loss_would_replace_every_worker() -> None:
    """Without GCS fault tolerance a lost head makes KubeRay replace every worker pod: a budget of no voluntary
    eviction, and the cluster autoscaler told not to evict it. With fault tolerance (or turned off): neither."""

    def head(sets: dict[str, str]) -> tuple[dict[str, Any] | None, dict[str, str]]:
        objects = render(["gpu.yaml"], sets)
        budget = next((o for o in objects if o["metadata"]["name"] == "pd-pdserve-ray-head"), None)
        template = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]
        return budget, template["metadata"].get("annotations", {})

    budget, annotations = head({})
    # KubeRay owns the pod and the RayCluster has no scale subresource: for such a pod Kubernetes supports only an
    # integer minAvailable, never maxUnavailable (its docs, "Specifying a Disruption Budget").
    assert budget is not None and budget["kind"] == "PodDisruptionBudget"
    assert budget["spec"] == {"minAvailable": 1, "selector": budget["spec"]["selector"]}
    assert annotations == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    tolerant = {"ray.gcsFaultTolerance.enabled": "true", "ray.gcsFaultTolerance.redisAddress": "redis.data:6379"}
    assert head(tolerant) == (None, {})
    assert head({"ray.head.pdb.enabled": "false"}) == (None, {})


@pytest.mark.parametrize("grace", [15, 40, 300])
def test_the_routers_drain_is_what_its_grace_period_leaves(grace: int) -> None:
    """router.terminationGracePeriodSeconds bounds the preStop sleep, the drain and the stop after it: the router's
    --drain-grace-s is what the grace period leaves, and liveness (NOT_SERVING while draining) outlasts it."""
    template = one(render(sets={"router.terminationGracePeriodSeconds": str(grace)}), "Deployment", ROUTER)["spec"]
    router = container(template["template"])
    sleep = int(router["lifecycle"]["preStop"]["exec"]["command"][-1])
    args = cli._parser().parse_args(router["args"])
    drain = flag_values(ClusterConfig, args)["drain_grace_s"]  # what `pdserve router` drains for
    assert template["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    assert drain == grace - sleep - 5 > 0  # 5 s left to stop the server and close the registry
    assert _window(router["livenessProbe"]) > drain


def router_config_map(objects: Objects) -> dict[str, Any]:
    """The ConfigMap the router pods mount."""
    (volume,) = [
        v for v in one(objects, "Deployment", ROUTER)["spec"]["template"]["spec"]["volumes"] if "configMap" in v
    ]
    return one(objects, "ConfigMap", volume["configMap"]["name"])


def test_router_reads_its_toml_and_the_contract_flags(rendered: dict[str, Objects], tmp_path: Any) -> None:
    objects = render(["gpu.yaml"], {"router.config.slo_headroom": 0.7, "router.config.max_attempts": "2"})
    toml = router_config_map(objects)["data"]["router.toml"]
    (tmp_path / "router.toml").write_text(toml)
    config = RouterConfig.from_file(str(tmp_path / "router.toml"))
    assert (config.slo_headroom, config.max_attempts, config.policy) == (0.7, 2, "slo")
    assert config.default_ttft_ms == 5000
    args = args_of(objects, ROUTER)
    assert args[0] == "router" and flag(args, "--router-config") == "/etc/pdserve/router/router.toml"
    assert "--no-reflection" in args
    assert (flag(args, "--host"), flag(args, "--port"), flag(args, "--metrics-port")) == ("0.0.0.0", "50051", "9400")


def test_the_routers_config_map_is_named_after_its_content_so_an_upgrade_leaves_the_earlier_pods_theirs() -> None:
    """A router of the earlier build refuses keys it does not know: one of its pods restarting mid-rollout must
    read the file it was made with, not the upgrade's (under one name the kubelet hands it the new file)."""
    names = {
        limit: router_config_map(render(["gpu.yaml"], {"router.config.request_limits.max_stop": limit}))
        for limit in (3, 4)
    }
    assert names[3]["metadata"]["name"] != names[4]["metadata"]["name"]
    assert all(m["metadata"]["name"].startswith(f"{ROUTER}-") for m in names.values())
    same = router_config_map(render(["gpu.yaml"], {"router.config.request_limits.max_stop": 3, "router.replicas": 5}))
    assert same["metadata"]["name"] == names[3]["metadata"]["name"]  # the same file: the same name, no rollout


def test_every_listener_binds_the_address_family_the_cluster_has() -> None:
    """IPv4 by default; "::" (dual-stack) for an IPv6 cluster, whose POD_IP the workers then advertise and a
    listener on 0.0.0.0 could not be reached at. Anything else is refused at install."""
    objects = render(["gpu.yaml"], {"bindAddress": "::"})
    assert flag(args_of(objects, ROUTER), "--host") == "::"
    assert flag(args_of(objects, "pd-pdserve-controller"), "--bind-host") == "::"
    assert "bindAddress" in render_error(sets={"bindAddress": "127.0.0.1"})


def test_pods_run_as_non_root_and_only_the_controller_and_the_autoscaler_hold_an_api_token(
    rendered: dict[str, Objects],
) -> None:
    for component, template in pod_templates(rendered["gpu.yaml"]).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, component
        assert spec["automountServiceAccountToken"] is (component in ("controller", "ray-head")), component
    # The head's token is KubeRay's account for the autoscaler sidecar, not the chart's (the controller's).
    assert "serviceAccountName" not in pod_templates(rendered["gpu.yaml"])["ray-head"]["spec"]
    head = pod_templates(render(["gpu.yaml"], {"ray.autoscaler.enabled": "false"}))["ray-head"]["spec"]
    assert head["automountServiceAccountToken"] is False


@pytest.mark.parametrize("enabled", [True, False])
def test_ray_autoscaler_gives_pending_worker_actors_their_pods(enabled: bool) -> None:
    """On: Ray's autoscaler adds a pod to a group when an actor waits for its role's resource (a live scale), with
    the Ray token every Ray process carries; off: replicas stay what the chart or `scale --kubernetes` set."""
    objects = render(["gpu.yaml"], {"ray.autoscaler.enabled": str(enabled).lower()})
    spec = one(objects, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is enabled
    # Workers ask for their image's pods only where the autoscaler brings such pods.
    assert ("--build-resources" in args_of(objects, "pd-pdserve-controller")) is enabled
    if not enabled:
        assert "autoscalerOptions" not in spec
        return
    options = spec["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] == 60 and options["upscalingMode"] == "Default"
    assert {e["name"] for e in options["env"]} == {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "NVIDIA_VISIBLE_DEVICES", "HOME"}
    assert options["securityContext"]["allowPrivilegeEscalation"] is False  # the head pod's context: non-root


@pytest.mark.parametrize(
    ("sets", "warned"),
    [
        ({}, set()),
        ({"decode.maxReplicas": "1"}, {"decode"}),
        ({"prefill.maxReplicas": "1", "decode.maxReplicas": "1"}, {"prefill", "decode"}),
        # two workers: one drains at a time while the other serves
        ({"prefill.replicas": "2", "prefill.minReplicas": "2", "prefill.maxReplicas": "2"}, set()),
        ({"decode.maxReplicas": "1", "ray.autoscaler.enabled": "false"}, set()),  # no new pod would come anyway
    ],
)
def test_install_notes_warn_when_an_upgrade_would_leave_a_role_empty(sets: dict[str, str], warned: set[str]) -> None:
    """A role's only worker is surged on an upgrade (its successor starts on a new pod first); at maxReplicas 1
    there is no room, so the install says how to keep serving through upgrades."""
    text = notes(sets=sets)
    assert {role for role in ("prefill", "decode") if f"{role}.maxReplicas is 1" in text} == warned


@pytest.mark.parametrize("enabled", [True, False])
def test_routers_scale_on_cpu_when_autoscaling_is_on(enabled: bool) -> None:
    """With autoscaling on, a HorizontalPodAutoscaler owns the router Deployment's count (the Deployment names
    none, so a `helm upgrade` does not reset it); off, the Deployment keeps router.replicas."""
    objects = render(sets={"router.autoscaling.enabled": str(enabled).lower(), "router.replicas": "3"})
    deployment = one(objects, "Deployment", "pd-pdserve-router")
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    if not enabled:
        assert not hpas and deployment["spec"]["replicas"] == 3
        return
    (hpa,) = hpas
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pd-pdserve-router"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"]  # what utilization is measured against


def test_every_pod_runs_under_the_runtimes_default_seccomp_profile(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """What Pod Security "restricted" asks besides non-root and no capabilities: a namespace enforcing it admits
    every pod of the chart."""
    for values, objects in rendered.items():
        for component, template in pod_templates(objects).items():
            pod = template["spec"].get("securityContext", {})
            assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, (values, component)
            assert pod.get("runAsNonRoot") is True, (values, component)


def test_every_container_an_init_container_included_asks_for_cpu_and_memory(rendered: dict[str, Objects]) -> None:
    """A namespace with a ResourceQuota on cpu and memory refuses a pod any of whose containers, init ones too,
    leaves them out (KubeRay gives its own init container resources for this reason)."""
    for values, objects in rendered.items():
        for component, template in pod_templates(objects).items():
            spec = template["spec"]
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                requests = c.get("resources", {}).get("requests", {})
                assert {"cpu", "memory"} <= set(requests), (values, component, c["name"])


def test_a_container_without_a_gpu_request_sees_no_gpu(rendered: dict[str, Objects]) -> None:
    """The image's CUDA base sets NVIDIA_VISIBLE_DEVICES=all: on a node whose default runtime is nvidia every
    container of it that asks for no GPU (router, controller, Ray head and its autoscaler, init containers, CPU
    workers) would see all the node's GPUs, so those say void; a GPU worker's is the device plugin's to set."""
    for values, objects in rendered.items():
        image = container(pod_templates(objects)["controller"])["image"]
        rc = one(objects, "RayCluster")["spec"]
        autoscaler = {"name": "autoscaler", "image": image, "env": rc["autoscalerOptions"]["env"]}
        for component, template in [
            *pod_templates(objects).items(),
            ("ray-autoscaler", {"spec": {"containers": [autoscaler]}}),
        ]:
            spec = template["spec"]
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                if c["image"] != image:  # Redis: its image sets no NVIDIA_VISIBLE_DEVICES
                    continue
                gpu = "nvidia.com/gpu" in c.get("resources", {}).get("requests", {})
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert env.get("NVIDIA_VISIBLE_DEVICES") == (None if gpu else "void"), (values, component, c["name"])
    assert "nvidia.com/gpu" in json.dumps(worker_groups(rendered["gpu.yaml"]))  # both kinds were checked


def test_every_pod_pulls_with_the_charts_image_pull_secrets() -> None:
    """A private registry (a mirrored Redis, the pdserve image for `helm test`): every pod the chart makes."""
    objects = render(["gpu.yaml"], {"imagePullSecrets": [{"name": "regcred"}]})
    for component, template in pod_templates(objects).items():
        assert template["spec"].get("imagePullSecrets") == [{"name": "regcred"}], component
