"""The router's keys as their file says: a reload swaps the table and trims the quotas to the keys it kept (their
counts carried over under their new caps, a removed key's forgotten); a file that cannot be read leaves the keys in
use, said once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.errors import OverloadedError, UnauthenticatedError
from pdserve.security.api_keys import Tenant, digest
from pdserve.security.quotas import LocalQuotas
from services.router.key_reload import KeyReload
from tests.unit.router.router_builder import Router


def keys_file(**streams: int) -> str:
    """Each key (named as its tenant) with its max_concurrent."""
    return "".join(
        f'[[keys]]\nname = "{k}"\nsha256 = "{digest(k)}"\ntenant = "{k}"\nmax_concurrent = {n}\n'
        for k, n in streams.items()
    )


async def test_a_reload_swaps_the_keys_and_trims_the_quotas_to_them(tmp_path: Path, caplog) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(keys_file(a=1, b=1))
    reload = KeyReload(str(path))
    lifecycle = Router([]).lifecycle(reload.table, LocalQuotas())

    def tenant(key: str) -> Tenant:
        return lifecycle.authenticate({"authorization": f"Bearer {key}"})

    a, b = tenant("a"), tenant("b")
    async with lifecycle.quotas.session(a), lifecycle.quotas.session(b):  # open across the reloads
        path.write_text(keys_file(a=2))  # b revoked, a allowed two
        reload.reload(lifecycle)
        with pytest.raises(UnauthenticatedError):
            tenant("b")
        async with lifecycle.quotas.session(tenant("a")):  # its second, under the new cap
            with pytest.raises(OverloadedError, match="max_concurrent"):  # a third: the open one was carried over
                async with lifecycle.quotas.session(tenant("a")):
                    pass
        path.unlink()  # a Secret's files mid-swap: nothing to read
        with caplog.at_level(logging.ERROR, logger="services.router.key_reload"):
            reload.reload(lifecycle)
            reload.reload(lifecycle)
        assert len(caplog.records) == 1 and "cannot be read" in caplog.records[0].getMessage()
        assert tenant("a").max_concurrent == 2  # the keys in use stay
        path.write_text(keys_file(a=2, b=1))  # b back: a key of its own, nothing of the revoked one's counts
        reload.reload(lifecycle)
        async with lifecycle.quotas.session(tenant("b")):
            pass


async def test_the_tenants_weights_are_the_files_from_the_start_and_after_each_reload(tmp_path: Path) -> None:
    """What admission's fair share weighs each tenant by (services/router/tenant_shares.py)."""
    path = tmp_path / "keys.toml"
    path.write_text(keys_file(a=1, b=1) + '[[tenants]]\nname = "a"\nweight = 3\n')
    reload = KeyReload(str(path))
    lifecycle = Router([]).lifecycle(reload.table, LocalQuotas())
    assert lifecycle.admission.shares.weights == {"a": 3.0}
    path.write_text(keys_file(a=1, b=1) + '[[tenants]]\nname = "b"\nweight = 0.5\n')
    reload.reload(lifecycle)
    assert lifecycle.admission.shares.weights == {"b": 0.5}
