"""What `helm install` prints (NOTES.txt): each command it gives runs as printed, with the flags the release's
TLS and API keys ask of a client, and the counts it states are the release's."""

from __future__ import annotations

import shlex
from typing import Any

import pytest

from tests.deploy.chart import notes
from tests.deploy.test_chart_commands import parse

TLS = {"tls.enabled": "true", "tls.publicSecret": "pub", "tls.internalSecret": "int"}
MTLS = {**TLS, "tls.clientCASecret": "clients"}
KEYS = {"apiKeys.existingSecret": "keys", "apiKeys.drainKey.existingSecret": "drain"}


def commands(text: str) -> dict[str, list[str]]:
    """Each command line of the notes (a pipe's first command), by its program and first words past kubectl's
    namespace (`pdserve status`, `kubectl get secret`, `kubectl port-forward svc/...`)."""
    found = {}
    for line in text.splitlines():
        if line.startswith("  pdserve ") or line.startswith("  kubectl "):
            argv = shlex.split(line.split(" | ")[0], comments=True)
            words = [a for a in argv if not a.startswith("-")]
            found[" ".join(words[:2] if argv[0] == "pdserve" else [words[0], *words[2:4]])] = argv
    return found


@pytest.mark.parametrize(
    ("sets", "flags"),
    [
        ({}, set()),
        (TLS, {"--tls-ca", "--tls-server-name"}),
        (MTLS, {"--tls-ca", "--tls-server-name", "--tls-cert", "--tls-key"}),
        (KEYS, {"--api-key"}),
        ({**MTLS, **KEYS}, {"--tls-ca", "--tls-server-name", "--tls-cert", "--tls-key", "--api-key"}),
    ],
    ids=["plain", "tls", "mtls", "api-keys", "mtls-api-keys"],
)
def test_the_printed_commands_run_against_the_port_forward(sets: dict[str, Any], flags: set[str]) -> None:
    """After `kubectl port-forward` the router is at 127.0.0.1 (not the Service's name, which resolves only in the
    cluster): with TLS the commands name the certificate's name and the CA, with client certificates one of
    theirs, and with API keys a key, each a flag `pdserve status` / `client` has."""
    text = notes(sets=sets)
    found = commands(text)
    assert found["kubectl port-forward svc/pd-pdserve-router"] == shlex.split(
        "kubectl -n serving port-forward svc/pd-pdserve-router 50051 &"
    )
    for name in ("pdserve status", "pdserve client"):
        argv = found[name][1:]
        args = parse(argv)
        assert args.addr == "127.0.0.1:50051", name
        assert {a for a in argv if a.startswith("--tls") or a == "--api-key"} == flags, name
        if "--tls-server-name" in flags:
            assert args.tls_server_name == "pd-pdserve-router" and args.tls_ca == "ca.crt", name
    if "--tls-ca" in flags:  # where ca.crt comes from: the public Secret's CA
        assert found["kubectl get secret"][3:] == ["get", "secret", "pub", "-o", "jsonpath={.data.ca\\.crt}"]
    if "--tls-cert" in flags:
        assert "client.crt, client.key: a client certificate signed by the CA in clients" in text
    if "--api-key" in flags:  # the drain key, the only one the chart knows, may not read the status
        assert 'admin = true or admin = ["ClusterStatus"]' in text


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        ({}, "  - 2 router pod(s) behind Service pd-pdserve-router"),
        ({"router.autoscaling.enabled": "true"}, "  - 2..8 router pods (a HorizontalPodAutoscaler on CPU) behind"),
    ],
)
def test_the_notes_state_the_router_count_that_applies(sets: dict[str, str], says: str) -> None:
    assert says in notes(sets=sets)
