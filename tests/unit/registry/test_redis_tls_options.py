"""A `rediss://` registry checks the server's name against its certificate on every redis-py the package allows
(before 6, redis-py skipped the check unless told), and the URL's own options still win."""

from __future__ import annotations

from pdserve.registry.redis import connect, connect_async


def test_rediss_clients_check_the_servers_hostname_unless_the_url_says_otherwise():
    for client in (connect("rediss://redis.example:6380/0"), connect_async("rediss://redis.example:6380/0")):
        assert client.connection_pool.connection_kwargs["ssl_check_hostname"] is True
    opted_out = connect("rediss://redis.example:6380/0?ssl_check_hostname=false")
    assert opted_out.connection_pool.connection_kwargs["ssl_check_hostname"] is False
    assert "ssl_check_hostname" not in connect("redis://redis.example:6379/0").connection_pool.connection_kwargs
