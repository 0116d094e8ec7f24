"""Internal authentication is on by default wherever pdserve starts the whole cluster: a local `pdserve up` makes a
random cluster secret for its run when none is set (its workers inherit it), keeps one that is set, and a process
whose workers outlive it (a controller, a lone router, `up --ray-address`) makes none and warns."""

from __future__ import annotations

import logging
import os
from unittest import mock

import pytest

from pdserve.cluster.internal_security import prepare_internal_security
from pdserve.config import ClusterConfig
from pdserve.env import CLUSTER_SECRET_VAR


def test_up_makes_a_secret_for_its_run_unless_one_is_set() -> None:
    # patch.dict restores the environment whole: monkeypatch records nothing for a variable it deletes while unset,
    # so the secret `up` writes outlived the test (and made later in-process workers refuse their callers)
    with mock.patch.dict(os.environ):
        os.environ.pop(CLUSTER_SECRET_VAR, None)
        prepare_internal_security(ClusterConfig(), make_secret=True)
        made = os.environ[CLUSTER_SECRET_VAR]
        assert len(made) == 64 and set(made) <= set("0123456789abcdef")  # 32 random bytes, hex
        del os.environ[CLUSTER_SECRET_VAR]
        prepare_internal_security(ClusterConfig(), make_secret=True)
        assert os.environ[CLUSTER_SECRET_VAR] != made  # one per run, not a fixed default
        os.environ[CLUSTER_SECRET_VAR] = "the operator's"
        prepare_internal_security(ClusterConfig(), make_secret=True)
        assert os.environ[CLUSTER_SECRET_VAR] == "the operator's"


def test_a_process_whose_workers_outlive_it_makes_none_and_warns(monkeypatch, caplog) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.internal_security"):
        prepare_internal_security(ClusterConfig(), make_secret=False)
    assert CLUSTER_SECRET_VAR not in os.environ
    assert "PDSERVE_CLUSTER_SECRET is not set" in caplog.text


@pytest.mark.parametrize("command", ["up", "router", "controller"])
@pytest.mark.parametrize("secret", ["", "short"])
def test_a_secret_set_too_short_to_keep_anyone_out_is_refused_before_any_start(monkeypatch, capsys, command, secret):
    """An empty one (a Secret's empty key) ran the cluster open as if none were set; a short one is guessable."""
    from pdserve import cli
    from services.main import SERVICES

    def never(command: str) -> None:
        raise AssertionError("the cluster started")

    monkeypatch.setenv(CLUSTER_SECRET_VAR, secret)
    monkeypatch.setattr(cli, "_runner", never)
    joined = {"up": [], "router": ["--redis", "redis://127.0.0.1:1/0", "--port", "0"]}
    joined["controller"] = ["--redis", "redis://127.0.0.1:1/0", "--ray-address", "127.0.0.1:1"]
    argv = [command, "--model", "tiny-random", "--metrics-port", "0", *joined[command]]
    assert cli.main(argv, services=SERVICES) == 2
    err = capsys.readouterr().err
    assert err == (
        f"pdserve {command}: PDSERVE_CLUSTER_SECRET is set but has {len(secret)} characters, under the 16 a cluster "
        "secret needs (the chart makes 48 random ones); set a longer one on every process, or unset it (`pdserve up` "
        "then makes one per run; elsewhere the cluster runs open)\n"
    )
