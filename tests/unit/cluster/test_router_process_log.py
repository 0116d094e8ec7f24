"""The start-up line names the HTTP API's URL as a client must dial it: https when the router serves TLS (it said
http:// whatever it served, and a client copying it met a closed connection)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.cluster.router_process import start_router_process
from pdserve.config import ClusterConfig, RouterConfig
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry


@pytest.mark.parametrize(("tls", "scheme"), [(False, "http"), (True, "https")])
async def test_the_http_apis_url_says_https_when_it_serves_tls(tls: bool, scheme: str, caplog) -> None:
    async def start_router(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return SimpleNamespace(http=SimpleNamespace(port=8443)), None

    files = {"tls_cert": "server.pem", "tls_key": "server.key"} if tls else {}
    config = ClusterConfig(router=RouterConfig(**files), http_port=8443)
    with caplog.at_level(logging.INFO, logger="pdserve.cluster.router_process"):
        telemetry = Telemetry("pdserve-router", enabled=False)
        await start_router_process(config, start_router, InMemoryRegistry(), InMemoryPrefixIndex(), telemetry)
    assert f"router OpenAI-compatible HTTP API at {scheme}://127.0.0.1:8443/v1" in caplog.messages
