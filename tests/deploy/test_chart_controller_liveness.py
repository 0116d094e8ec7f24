"""The controller's probes: both ask its /healthz on the metrics port (the supervision loop's progress,
pdserve.cluster.liveness), and the startup probe outlasts the longest start the controller's own timeouts allow, so
the kubelet never restarts a controller still joining Ray or waiting for its workers."""

from __future__ import annotations

from typing import Any

from pdserve.cluster.launcher import JOIN_RETRY_S, JOIN_WINDOW_S
from pdserve.cluster.scaling import START_TIMEOUT_S
from pdserve.telemetry import HEALTH_PATH
from tests.deploy.chart import container, pod_templates, render

RAY_CLIENT_TRY_S = 30  # Ray Client's own connection timeout: each join try takes it (launcher.JOIN_WINDOW_S)


def controller(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return container(pod_templates(objects)["controller"])


def longest_start_s(prefill_max: int, decode_max: int) -> float:
    """Redis waited for and Ray's join tried within one window (a try of Ray's begun just before its end runs its
    course), then each worker waited for in turn, up to START_TIMEOUT_S each, up to every pod each group may have."""
    return JOIN_WINDOW_S + RAY_CLIENT_TRY_S + JOIN_RETRY_S + START_TIMEOUT_S * (prefill_max + decode_max)


def test_the_controllers_probes_ask_its_health_path_on_the_metrics_port(rendered: dict[str, Any]) -> None:
    c = controller(rendered["gpu.yaml"])
    metrics_port = int(c["args"][c["args"].index("--metrics-port") + 1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == metrics_port
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": HEALTH_PATH, "port": "metrics"}, probe
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 30  # no hair trigger


def test_the_startup_probe_outlasts_the_longest_start() -> None:
    for prefill_max, decode_max in ((8, 8), (1, 1), (64, 64)):
        sets = {"prefill.maxReplicas": str(prefill_max), "decode.maxReplicas": str(decode_max)}
        startup = controller(render(sets=sets))["startupProbe"]
        window = startup["periodSeconds"] * startup["failureThreshold"]
        assert longest_start_s(prefill_max, decode_max) <= window <= longest_start_s(prefill_max, decode_max) + 120
