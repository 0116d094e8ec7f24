"""`pdserve drain` of every serving worker of a role is refused (exit 2) unless --force, naming the role and what
its callers would see; `pdserve restart` surges such a worker instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve import drain_commands
from pdserve.drain_commands import roles_emptied


def worker(worker_id: str, role: str, health: str = "SERVING", draining: bool = False) -> SimpleNamespace:
    return SimpleNamespace(id=worker_id, role=role, health=health, draining=draining)


@pytest.mark.parametrize(
    ("workers", "drained", "said"),
    [
        ([worker("p0", "prefill"), worker("d1", "decode")], {"d1"}, "d1 is every decode worker serving"),
        ([worker("d1", "decode"), worker("d2", "decode")], {"d1"}, None),
        ([worker("d1", "decode"), worker("d2", "decode")], {"d1", "d2"}, "d1, d2 are every decode worker serving"),
        ([worker("d1", "decode"), worker("d2", "decode", draining=True)], {"d1"}, "d1 is every decode"),
        ([worker("d1", "decode"), worker("d2", "decode", health="NOT_SERVING")], {"d1"}, "d1 is every decode"),
    ],
)
def test_draining_a_roles_last_serving_worker_is_found(workers, drained, said):
    found = roles_emptied(workers, drained)
    if said is None:
        assert found == []
    else:
        assert len(found) == 1 and said in found[0] and "UNAVAILABLE" in found[0], found


@pytest.mark.parametrize("force", [False, True])
def test_it_is_refused_unless_forced(monkeypatch, capsys, force):
    drained: list[list[str]] = []

    async def listed(addr, creds):
        return [worker("p0", "prefill"), worker("d1", "decode")]

    async def drain(addr, worker_ids, *rest):
        drained.append(worker_ids)
        return 0

    monkeypatch.setattr(drain_commands, "_workers", listed)
    monkeypatch.setattr(drain_commands, "_drain_and_print", drain)
    argv = ["drain", "--addr", "127.0.0.1:1", "d1", *(["--force"] if force else [])]
    from pdserve.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert (code, drained) == ((0, [["d1"]]) if force else (2, []))
    assert f"pdserve drain: {'warning' if force else 'refused'}: d1 is every decode worker serving" in err
    assert force or "pdserve restart WORKER_ID" in err


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("code", ["PERMISSION_DENIED", "DEADLINE_EXCEEDED"])
def test_a_drain_it_could_not_check_is_refused_unless_forced(monkeypatch, capsys, force, code):
    """A key that may drain but not read the status: the drain might empty a role, so it is refused as one that
    would, saying why (not that `restart`, which reads it too, would do). --force drains whatever kept the check
    from an answer (a router slow to answer it); unforced, any other failure is the drain's own
    (test_command_errors.py)."""
    import grpc

    drained: list[list[str]] = []

    async def not_allowed(addr, creds):
        raise grpc.aio.AioRpcError(getattr(grpc.StatusCode, code), None, None, "may call only DrainWorkers")

    async def drain(addr, worker_ids, *rest):
        drained.append(worker_ids)
        return 0

    monkeypatch.setattr(drain_commands, "_workers", not_allowed)
    monkeypatch.setattr(drain_commands, "_drain_and_print", drain)
    from pdserve.cli import main

    exit_code = main(["drain", "--addr", "127.0.0.1:1", "d1", *(["--force"] * force)])
    err = capsys.readouterr().err
    if code == "DEADLINE_EXCEEDED" and not force:
        assert (exit_code, drained) == (1, []) and "pdserve drain: DEADLINE_EXCEEDED: " in err, err
        return
    assert (exit_code, drained) == ((0, [["d1"]]) if force else (2, []))
    said = f"pdserve drain: {'warning' if force else 'refused'}: could not check that the drain leaves each role a "
    assert said + "worker (may call only DrainWorkers)" in err, err
    assert "restart" not in err
