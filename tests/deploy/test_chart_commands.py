"""Every command line the chart renders parses with the real `pdserve` parser: the router, the controller, the
model fetch, the preStop drain, and the TLS health probe. A subcommand another slice adds (controller, router,
drain) is skipped while it is not on this branch, and checked once it is: a renamed flag fails here, not in a
cluster."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import pytest

from pdserve import cli
from pdserve.config import RouterConfig
from pdserve.flags import flag_values
from pdserve.rpc import health_probe
from tests.deploy.chart import pod_templates, render
from tests.deploy.conftest import EXAMPLE_FILES

Objects = list[dict[str, Any]]
POD_IP = "10.1.2.3"


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def parse(argv: list[str]) -> argparse.Namespace:
    """argv parsed by `pdserve`: failed when the command or a flag the chart gives it does not exist."""
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert argv[0] in commands, f"the chart runs `pdserve {argv[0]}`, which is no command"
    missing = {a for a in argv[1:] if a.startswith("--") and a not in _options(commands[argv[0]])}
    assert not missing, f"`pdserve {argv[0]}` has no {', '.join(sorted(missing))}"
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"pdserve does not parse the chart's command line: {shlex.join(argv)}")


def command_lines(objects: Objects) -> dict[str, list[str]]:
    """Each pdserve command line of the render (the init containers' are all the same fetch)."""
    pods = pod_templates(objects)
    lines = {c: pods[c]["spec"]["containers"][0]["args"] for c in ("router", "controller")}
    decode = pods["decode"]["spec"]
    lines["fetch"] = decode["initContainers"][0]["args"]
    script = decode["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
    ray_drain, pdserve_drain = script.replace("$POD_IP", POD_IP).splitlines()
    drain = shlex.split(pdserve_drain)
    assert drain[0] == "pdserve"
    lines["drain"] = drain[1:]
    lines["ray drain-node"] = shlex.split(ray_drain.removesuffix("|| true"))[2:]  # after `timeout 10`
    lines["client"] = pods["smoke-test"]["spec"]["containers"][0]["args"]  # `helm test`
    return lines


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.scripts imports Ray Serve's pydantic models
def test_ray_drain_node_parses(rendered: dict[str, Objects]) -> None:
    """`ray drain-node` is hidden in Ray's CLI (no stability promise): its options are checked against the Ray
    installed here, the one the image installs."""
    from ray.scripts.scripts import drain_node

    argv = command_lines(rendered["gpu.yaml"])["ray drain-node"]
    assert argv[:2] == ["ray", "drain-node"]
    context = drain_node.make_context("drain-node", argv[2:])
    assert context.params["reason"] == "DRAIN_NODE_REASON_PREEMPTION"
    assert context.params["deadline_remaining_seconds"] == 80


@pytest.fixture(scope="module")
def with_api_keys() -> Objects:
    no_tls = {"tls.enabled": "false", "tls.publicSecret": "", "tls.clientCASecret": "", "tls.internalSecret": ""}
    return render(["external-redis-tls-monitoring.yaml"], no_tls)


@pytest.mark.parametrize("command", ["router", "controller", "fetch", "drain", "client"])
@pytest.mark.parametrize("values", [*EXAMPLE_FILES, "api-keys without TLS"])
def test_command_line_parses(rendered: dict[str, Objects], with_api_keys: Objects, values: str, command: str) -> None:
    objects = with_api_keys if values == "api-keys without TLS" else rendered[values]
    argv = command_lines(objects)[command]
    assert argv[0] == command
    args = parse(argv)
    if command in ("router", "controller", "fetch"):
        assert args.model == argv[argv.index("--model") + 1]
    if command == "drain":
        assert POD_IP in argv


@pytest.mark.parametrize("component", ["router", "prefill"])
def test_tls_health_probe_parses(rendered: dict[str, Objects], component: str) -> None:
    container = pod_templates(rendered["external-redis-tls-monitoring.yaml"])[component]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        args = health_probe.parser().parse_args(command[3:])
        assert args.tls_ca and args.server_name


def test_every_process_given_internal_tls_is_given_the_internal_server_name() -> None:
    """Peers dial pod IPs, which the internal certificate cannot name: each pdserve process the chart starts with
    internal TLS (its workers inherit it) checks peers for tls.internalServerName instead."""
    objects = render(["external-redis-tls-monitoring.yaml"], {"tls.internalServerName": "mesh.pdserve"})
    given = {name: argv for name, argv in command_lines(objects).items() if "--internal-tls-cert" in argv}
    assert set(given) == {"router", "controller"}
    for name, argv in given.items():
        assert argv[argv.index("--internal-tls-server-name") + 1] == "mesh.pdserve", name
        assert parse(argv).internal_tls_server_name == "mesh.pdserve", name


def test_clients_of_the_public_port_check_its_name_and_present_the_internal_certificate() -> None:
    """The preStop drain and `helm test` dial the router Service, whose name need not be the one the router's
    certificate carries (tls.serverName), and, where tls.clientCASecret makes the router ask for a client
    certificate, present the pod's internal one, as the router's own probes do: the router takes it because it
    is given the cluster CA (--internal-tls-ca) beside the client CA."""
    objects = render(["external-redis-tls-monitoring.yaml"], {"tls.serverName": "api.example.com"})
    lines = command_lines(objects)
    router = parse(lines["router"])
    assert router.tls_client_ca and router.internal_tls_ca
    for name in ("drain", "client"):
        args = parse(lines[name])
        assert args.tls_server_name == "api.example.com", name
        assert (args.tls_cert, args.tls_key) == (router.internal_tls_cert, router.internal_tls_key), name
    probe = pod_templates(objects)["router"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    probe_args = health_probe.parser().parse_args(probe[3:])
    assert probe_args.server_name == "api.example.com"
    assert (probe_args.tls_cert, probe_args.tls_key) == (router.internal_tls_cert, router.internal_tls_key)


@pytest.mark.parametrize("http_port", ["8000", "0"])
def test_the_http_api_is_served_and_exposed_on_its_port_unless_off(http_port: str) -> None:
    objects = render(sets={"router.httpPort": http_port})
    args = parse(command_lines(objects)["router"])
    router = pod_templates(objects)["router"]["spec"]["containers"][0]
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "pd-pdserve-router")
    served = {p["containerPort"] for p in router["ports"] if p["name"] == "http"}
    exposed = {(p["port"], p["targetPort"]) for p in service["spec"]["ports"] if p["name"] == "http"}
    if http_port == "0":
        assert not args.http_port and not served and not exposed
    else:
        assert args.http_port == 8000 and served == {8000} and exposed == {(8000, "http")}


def test_the_kv_cache_size_reaches_the_workers_command_line() -> None:
    assert parse(command_lines(render(sets={"engine.kvCacheGb": "40"}))["controller"]).kv_cache_gb == 40.0
    assert "--kv-cache-gb" not in command_lines(render())["controller"]  # pdserve's own default


@pytest.mark.parametrize(
    ("sets", "device"),
    [
        ({}, "cuda"),  # the default worker pods hold a GPU each
        ({"prefill.gpus": 0, "decode.gpus": 0}, "cpu"),
        ({"engine.device": "auto"}, "auto"),  # as the operator says
        ({"prefill.gpus": 0, "decode.gpus": 0, "engine.device": "cuda"}, "cuda"),
    ],
)
def test_the_workers_device_follows_their_pods_gpus_unless_set(sets: dict[str, object], device: str) -> None:
    """pdserve's "auto" asks Ray for GPUs when the controller starts, before any worker pod exists under the
    autoscaler: the workers would then ask Ray for none while running on the pods' GPUs."""
    assert parse(command_lines(render(sets=sets))["controller"]).device == device


@pytest.mark.parametrize("credentials", [False, True])
def test_the_http_apis_cors_origins_reach_the_router_as_it_takes_them(credentials: bool) -> None:
    origins = ["https://chat.example.com", "http://localhost:5173", "https://*.preview.example.com"]
    sets = {"router.httpCors.origins": origins, "router.httpCors.allowCredentials": credentials}
    router = RouterConfig(**flag_values(RouterConfig, parse(command_lines(render(sets=sets))["router"])))
    assert router.http_cors_origins == tuple(origins) and router.http_cors_allow_credentials is credentials
    default = RouterConfig(**flag_values(RouterConfig, parse(command_lines(render())["router"])))
    assert default.http_cors_origins == () and not default.http_cors_allow_credentials
