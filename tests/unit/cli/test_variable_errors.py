"""A cluster command refuses a setting an environment variable gave wrong before it starts anything, exit status 2,
naming the variable the operator set and its value (a secret's is never shown: test_internal_security.py), as a
flag's is named (`--stall-timeout-s must be ...`). Before, a fault knob that is no number failed each worker's start
with `could not convert string to float`, a Redis CA file that is not there made `up` say its --redis did not
answer (and a router wait for it for ever), and one internal TLS file set without the other two ran in plaintext."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve import cli
from services.main import SERVICES

JOINED = {
    "up": [],
    "router": ["--redis", "rediss://127.0.0.1:1/0", "--port", "0"],
    "controller": ["--redis", "rediss://127.0.0.1:1/0", "--ray-address", "127.0.0.1:1"],
}


def refusal(command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """What `command` says on stderr, having exited 2 before anything ran."""

    def never(command: str) -> None:
        raise AssertionError("the cluster started")

    monkeypatch.setattr(cli, "_runner", never)
    argv = [command, "--model", "tiny-random", "--metrics-port", "0", *JOINED[command]]
    assert cli.main(argv, services=SERVICES) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["up", "controller"])
@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("PDSERVE_FAULT_SLOW_STEP_S", "soon", "must be a number of seconds"),
        ("PDSERVE_FAULT_KV_SEND_DELAY_S", "-1", "must be a finite number of seconds >= 0, got -1.0"),
        ("PDSERVE_FAULT_SLOW_STEP_S", "inf", "must be a finite number of seconds >= 0, got inf"),
        ("PDSERVE_FAULT_SLOW_PROFILE_TIMES", "twice", "must be a number"),
        ("PDSERVE_FAULT_SLOW_PROFILE_TIMES", "0", "must be a finite number > 0, got 0.0"),
    ],
)
def test_a_fault_knob_that_is_no_time_is_named(monkeypatch, capsys, command, variable, value, problem) -> None:
    monkeypatch.setenv(variable, value)
    assert refusal(command, monkeypatch, capsys) == f"pdserve {command}: {variable}={value!r} {problem}\n"


@pytest.mark.parametrize("command", ["router", "controller"])
def test_a_redis_ca_file_that_cannot_be_read_is_named(monkeypatch, capsys, tmp_path: Path, command: str) -> None:
    missing = str(tmp_path / "redis-ca.pem")
    monkeypatch.setenv("PDSERVE_REDIS_CA_CERT", missing)
    err = refusal(command, monkeypatch, capsys)
    assert err == f"pdserve {command}: PDSERVE_REDIS_CA_CERT={missing!r} cannot be read (No such file or directory)\n"


@pytest.mark.parametrize("command", ["up", "router"])
def test_an_internal_tls_file_set_without_the_other_two_is_named(monkeypatch, capsys, tmp_path, command) -> None:
    cert = tmp_path / "internal.pem"
    cert.write_text("not checked: the set is refused first")
    monkeypatch.setenv("PDSERVE_INTERNAL_TLS_CERT", str(cert))
    assert refusal(command, monkeypatch, capsys) == (
        f"pdserve {command}: PDSERVE_INTERNAL_TLS_CERT={str(cert)!r} is set but PDSERVE_INTERNAL_TLS_KEY and "
        "PDSERVE_INTERNAL_TLS_CA not: set all three of PDSERVE_INTERNAL_TLS_{CERT,KEY,CA} or none\n"
    )


def test_an_internal_tls_file_that_cannot_be_read_is_named(monkeypatch, capsys, tmp_path: Path) -> None:
    for name in ("CERT", "KEY", "CA"):
        (tmp_path / f"{name}.pem").write_text("")
        monkeypatch.setenv(f"PDSERVE_INTERNAL_TLS_{name}", str(tmp_path / f"{name}.pem"))
    (tmp_path / "KEY.pem").unlink()
    key = str(tmp_path / "KEY.pem")
    assert refusal("router", monkeypatch, capsys) == (
        f"pdserve router: PDSERVE_INTERNAL_TLS_KEY={key!r} cannot be read (No such file or directory)\n"
    )
