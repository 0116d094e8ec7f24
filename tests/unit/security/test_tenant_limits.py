"""A tenant's own limits (the key file's [[tenants]]), charged beside each of its keys': shared by all its keys,
so a tenant of two keys (a rotation's old and new) gets its budget once. In this router's memory and, through a
real redis-server, across two routers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.security.quotas import LocalQuotas
from pdserve.security.redis_quotas import RedisQuotas
from tests.redis_server import RedisServer, started

pytestmark = pytest.mark.timeout(60)
server = pytest.fixture(scope="module")(started)

FILE = b"""
[[tenants]]
name = "team"
max_concurrent = 1
requests_per_second = 2
tokens_per_minute = 600

[[keys]]
name = "old"
sha256 = "%s"
tenant = "team"

[[keys]]
name = "new"
sha256 = "%s"
tenant = "team"
tokens_per_minute = 250
max_concurrent = 1

[[keys]]
name = "other"
sha256 = "%s"
tenant = "elsewhere"
""" % tuple(digest(k).encode() for k in ("old", "new", "other"))


def keys() -> dict[str, Tenant]:
    table = KeyTable.parse(FILE, "keys.toml")
    return {t.key_name: t for t in table.tenants}


def test_the_keys_of_a_limited_tenant_share_its_limits_and_no_other_key_does():
    k = keys()
    assert k["old"].shared is k["new"].shared and k["old"].shared is not None
    assert (k["old"].shared.max_concurrent, k["old"].shared.who) == (1, "tenant 'team'")
    assert k["other"].shared is None and k["other"].holders == (k["other"],)
    assert [h.key_name for h in KeyTable.parse(FILE, "f").limits] == ["old", "tenant/team", "new", "other"]
    assert KeyTable.parse(FILE, "f").weights == {"team": 1.0}  # weight absent: 1


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (b'[[tenants]]\nname = "nobody"\n', "no key has that tenant"),
        (b'[[tenants]]\nname = "team"\n', "needs a name of its own"),
        (b'[[tenants]]\nname = "elsewhere"\nmax_streams = 1\n', "unknown max_streams"),
        (b'[[tenants]]\nname = "elsewhere"\nmax_concurrent = -1\n', "max_concurrent must be >= 0"),
        (b'[[tenants]]\nname = "elsewhere"\nweight = 0\n', "weight must be a positive number"),
        (b'[[tenants]]\nname = "elsewhere"\nweight = true\n', "weight must be a positive number"),
        (b'[[keys]]\nname = "tenant/x"\nsha256 = "%s"\ntenant = "x"\n' % digest("x").encode(), "may not start"),
    ],
)
def test_a_malformed_tenant_entry_fails_the_load_naming_it(extra, error):
    with pytest.raises(ValueError, match=error):
        KeyTable.parse(FILE + extra, "keys.toml")


async def test_one_stream_of_the_tenant_whichever_key_and_a_refusal_leaves_no_slot_of_the_key():
    k, quotas = keys(), LocalQuotas()
    async with quotas.session(k["old"]):
        with pytest.raises(OverloadedError, match="tenant 'team' has 1 streams open"):
            async with quotas.session(k["new"]):
                pass
        async with quotas.session(k["other"]):  # another tenant: its own limits only
            pass
    for _ in range(3):  # the refused one gave the key's stream back: new opens again and again
        async with quotas.session(k["new"]):
            pass


async def test_requests_and_tokens_of_the_tenant_are_counted_once_for_all_its_keys():
    k, quotas = keys(), LocalQuotas()
    await quotas.charge_request(k["old"])
    await quotas.charge_request(k["new"])  # the tenant's burst of 2
    with pytest.raises(OverloadedError, match="tenant 'team' is over its requests_per_second"):
        await quotas.charge_request(k["old"])
    async with quotas.session(k["old"]) as s:
        await s.charge_tokens(500)
        s.admitted()
    with pytest.raises(OverloadedError, match="tenant 'team' is over its tokens_per_minute"):
        async with quotas.session(k["new"]) as s:
            await s.charge_tokens(200)  # the key's 250 had them: taken, then given back with the refusal
    with pytest.raises(InvalidRequestError, match="more than tenant 'team' allows in one request"):
        async with quotas.session(k["old"]) as s:
            await s.charge_tokens(700)  # the key sets no limit; its tenant's whole minute is 600
    async with quotas.session(k["new"]) as s:
        await s.charge_tokens(100)  # the tenant's last 100, and 100 of the key's 250, all there again
        s.admitted()


@pytest.fixture
async def routers(server: RedisServer) -> AsyncIterator[tuple[RedisQuotas, RedisQuotas]]:
    with server.client() as c:
        c.flushall()
    a, b = RedisQuotas(server.url, budget_s=2.0), RedisQuotas(server.url, budget_s=2.0)
    yield a, b
    await a.close()
    await b.close()


async def test_across_routers_the_tenants_stream_is_one_for_all_its_keys(routers):
    a, b = routers
    k = keys()
    async with a.session(k["old"]):
        with pytest.raises(OverloadedError, match="tenant 'team' has 1 streams open"):
            async with b.session(k["new"]):
                pass
    await a.flush()
    async with b.session(k["new"]):
        pass
