"""`pdserve drain` of every serving worker of a role says that requests fail until a replacement serves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.drain_commands import _warn_if_a_role_empties


def worker(worker_id: str, role: str, health: str = "SERVING", draining: bool = False) -> SimpleNamespace:
    return SimpleNamespace(id=worker_id, role=role, health=health, draining=draining)


@pytest.mark.parametrize(
    ("workers", "drained", "warned"),
    [
        ([worker("p0", "prefill"), worker("d1", "decode")], {"d1"}, "d1 is every decode worker serving"),
        ([worker("d1", "decode"), worker("d2", "decode")], {"d1"}, None),
        ([worker("d1", "decode"), worker("d2", "decode")], {"d1", "d2"}, "d1, d2 are every decode worker serving"),
        ([worker("d1", "decode"), worker("d2", "decode", draining=True)], {"d1"}, "d1 is every decode"),
        ([worker("d1", "decode"), worker("d2", "decode", health="NOT_SERVING")], {"d1"}, "d1 is every decode"),
    ],
)
def test_draining_a_roles_last_serving_worker_is_said(capsys, workers, drained, warned):
    _warn_if_a_role_empties(workers, drained)
    err = capsys.readouterr().err
    if warned is None:
        assert err == ""
    else:
        assert warned in err and "UNAVAILABLE" in err and "pdserve restart" in err, err
