"""Every Admin call leaves one line in the router's log, granted or refused, with the call, the key's name (never the
key), the caller's address, the outcome and the arguments: a real in-process router on loopback, an API-key file."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pdserve.security.api_keys import bearer_metadata, digest
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc
from services.router.server import RouterServer
from tests.unit.router.test_admin_scopes import _router

pytestmark = pytest.mark.timeout(60)
ADMIN_KEY, DRAIN_KEY = "s3cret-admin-key-value", "s3cret-drain-key-value"


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterServer]:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "ops-admin"\nsha256 = "{digest(ADMIN_KEY)}"\ntenant = "ops"\nadmin = true\n'
        f'[[keys]]\nname = "pod-drain"\nsha256 = "{digest(DRAIN_KEY)}"\ntenant = "internal"\nadmin = ["DrainWorkers"]\n'
    )
    server = await _router(keys)
    yield server
    await server.stop(None)


async def call(address: str, method: str, request: object, key: str | None) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await getattr(admin_pb2_grpc.AdminStub(ch), method)(request, metadata=bearer_metadata(key), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_each_admin_call_granted_or_refused_logs_one_line(router, caplog) -> None:
    scale, status = apb.ScaleWorkersRequest(prefill=2, decode=3), apb.ClusterStatusRequest()
    drain = apb.DrainWorkersRequest(host="10.0.0.9", timeout_s=5)
    with caplog.at_level(logging.INFO, logger="services.router.admin_audit"):
        assert await call(router.address, "ClusterStatus", status, None) == grpc.StatusCode.UNAUTHENTICATED
        assert await call(router.address, "ClusterStatus", status, "a-guess") == grpc.StatusCode.UNAUTHENTICATED
        assert await call(router.address, "ScaleWorkers", scale, DRAIN_KEY) == grpc.StatusCode.PERMISSION_DENIED
        assert await call(router.address, "DrainWorkers", drain, DRAIN_KEY) == grpc.StatusCode.PERMISSION_DENIED
        assert await call(router.address, "ScaleWorkers", scale, ADMIN_KEY) == grpc.StatusCode.OK
    lines = [r for r in caplog.records if r.name == "services.router.admin_audit"]
    assert [(r.levelname, r.admin_call, r.key_name, r.admin_outcome) for r in lines] == [
        ("WARNING", "ClusterStatus", "(none)", "refused"),
        ("WARNING", "ClusterStatus", "(unknown key)", "refused"),
        ("WARNING", "ScaleWorkers", "pod-drain", "refused"),
        ("WARNING", "DrainWorkers", "pod-drain", "refused"),
        ("INFO", "ScaleWorkers", "ops-admin", "granted"),
    ]
    assert all(r.peer.startswith("ipv4:127.0.0.1:") for r in lines)
    assert (
        lines[-1].getMessage()
        == f"admin ScaleWorkers by key ops-admin from {lines[-1].peer}: granted (2 prefill, 3 decode)"
    )
    assert "host 10.0.0.9, timeout 5 s" in lines[3].getMessage() and "PermissionDeniedError" in lines[3].getMessage()
    text = caplog.text
    assert ADMIN_KEY not in text and DRAIN_KEY not in text and "a-guess" not in text  # names only, never keys
