"""A Redis that speaks only TLS, its certificate signed by a private CA (an in-cluster Redis with cert-manager, a
cloud Redis with its own server CA): the registry trusts it through PDSERVE_REDIS_CA_CERT, and the Ray head keeps
its GCS tables there through RAY_REDIS_CA_CERT, the variables the Helm chart sets from `redis.caSecret`. Without
the CA neither connects: the certificate is checked, never skipped."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pdserve.registry.base import WorkerState
from pdserve.registry.redis import RedisRegistry
from tests.certs import Certs, make_certs
from tests.integration.ray_nodes import RayNode, ray_env, remove_temp_dir
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def server(certs: Certs) -> Iterator[RedisServer]:
    srv = RedisServer(tls=certs)
    srv.start()
    yield srv
    srv.stop()


async def test_the_registry_trusts_the_redis_ca_it_is_given(
    server: RedisServer, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.url.startswith("rediss://")
    worker = WorkerState(worker_id="p-tls", role="prefill", address="p-tls:1")
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        RedisRegistry(server.url).publish(worker)  # the system's CAs do not know this one
    monkeypatch.setenv("PDSERVE_REDIS_CA_CERT", str(certs.ca))
    RedisRegistry(server.url).publish(worker)  # a worker's heartbeat (sync client)
    router = RedisRegistry(server.url)  # a router's view (async client)
    await router.start()
    try:
        assert [w.worker_id for w in router.workers()] == ["p-tls"]
    finally:
        await router.close()


@pytest.mark.parametrize("with_ca", [True, False])
def test_the_ray_head_keeps_its_gcs_tables_there_with_the_ca(server: RedisServer, certs: Certs, with_ca: bool) -> None:
    namespace = f"gcs-tls-{with_ca}"
    temp_dir = Path(tempfile.mkdtemp(prefix="pdtl", dir="/tmp"))  # short: Ray's socket paths must stay short
    env = {**ray_env(temp_dir), "RAY_REDIS_ADDRESS": f"rediss://127.0.0.1:{server.port}"}
    env |= {"RAY_external_storage_namespace": namespace, "RAY_redis_db_connect_retries": "5"}
    if with_ca:
        env["RAY_REDIS_CA_CERT"] = str(certs.ca)
    head = RayNode(temp_dir, {}, env=env)
    try:
        if with_ca:
            head.wait_started()
        else:
            with pytest.raises(RuntimeError, match="did not start"):  # its GCS cannot reach its Redis, and exits
                head.wait_started()
    finally:
        head.stop()
        remove_temp_dir(temp_dir)
    with server.client() as r:
        tables = r.keys(f"RAY{namespace}@*")
    assert bool(tables) == with_ca, tables
