"""A local Ray that does not start (its processes slower than the 30 s Ray waits, on a loaded machine), or a
--ray-address Ray will not join, ends `pdserve up` in one line naming Ray's reason and where to look, exit status 1:
each was a 50-line traceback ending in Ray's `Exception: The current node timed out during startup` or
`ValueError: Invalid address format`."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import ray

from pdserve.cli import main

RAY_SAYS = "The current node timed out during startup."
# `up` writes the cluster secret it made into this process's environment: kept, every in-process worker a later test
# module of this process starts would refuse its callers as no cluster peer.
pytestmark = pytest.mark.usefixtures("environment_kept")


@pytest.fixture
def environment_kept():
    with mock.patch.dict(os.environ):
        yield


def test_a_local_ray_that_does_not_start_is_one_line_naming_its_logs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.main import SERVICES

    def init(**_: object) -> None:
        raise Exception(RAY_SAYS)  # what Ray raises

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_TMPDIR", "/var/tmp/pdserve-test")
    argv = ["up", "--model", "tiny-random", "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    assert main(argv, services=SERVICES) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        f"pdserve up: the local Ray did not start: {RAY_SAYS} (its logs: /var/tmp/pdserve-test/ray/session_latest/logs;"
        " on a loaded machine, try again)"
    )


def test_a_ray_address_ray_will_not_join_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from services.main import SERVICES

    argv = ["up", "--model", "tiny-random", "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    assert main([*argv, "--ray-address", "not-an-address"], services=SERVICES) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        "pdserve up: could not join the Ray cluster at --ray-address not-an-address: Invalid address format: "
        "not-an-address"
    )
