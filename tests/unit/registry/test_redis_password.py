"""A Redis that requires a password: the registry authenticates with PDSERVE_REDIS_PASSWORD when the URL has
none, and a URL's own password wins."""

from __future__ import annotations

import pytest
import redis

from pdserve.registry.redis import connect, connect_async
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def server():
    srv = RedisServer(password="s3cret")
    srv.start()
    yield srv
    srv.stop()


async def test_the_password_comes_from_the_environment_or_the_url(server, monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)
    with pytest.raises(redis.AuthenticationError):
        connect(server.url).ping()
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "s3cret")
    assert connect(server.url).ping()
    client = connect_async(server.url)
    assert await client.ping()
    await client.aclose()
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "wrong")
    assert connect(server.url.replace("redis://", "redis://:s3cret@")).ping()
