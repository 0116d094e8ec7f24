"""A file flag of `up`, `controller` or `router` (or `plan`, `autoscale`) that names no readable file is one line
naming the flag and the path, exit status 2, before anything starts: it was open's own `[Errno 2] No such file or
directory: 'keys.toml'`, which names no flag, or `no such file: ca.pem`, which names no flag either."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve import cli
from pdserve.cli import main
from tests.unit.planner.synthetic import synthetic_profile

FLAGS = ["--router-config", "--api-keys", "--tls-cert", "--tls-key", "--tls-client-ca", "--internal-tls-ca"]


def _never_started(monkeypatch: pytest.MonkeyPatch) -> None:
    def runner(command: str) -> object:
        raise AssertionError(f"`{command}` started with a flag naming no file")

    monkeypatch.setattr(cli, "_runner", runner)


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize(("name", "why"), [("none.toml", "No such file or directory"), (".", "Is a directory")])
def test_a_file_flag_naming_no_readable_file_names_the_flag_and_the_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, name: str, why: str
) -> None:
    from services.main import SERVICES

    _never_started(monkeypatch)
    path = tmp_path / name
    assert main(["up", "--model", "tiny-random", "--port", "0", flag, str(path)], services=SERVICES) == 2
    assert capsys.readouterr().err == f"pdserve up: {flag} {path}: cannot be read ({why})\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["router", "--redis", "redis://127.0.0.1:1/0", "--api-keys"],
        ["controller", "--ray-address", "127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0", "--internal-tls-key"],
    ],
)
def test_router_and_controller_name_their_file_flags_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    from services.main import SERVICES

    _never_started(monkeypatch)
    path = tmp_path / "none.pem"
    assert main([*argv, str(path), "--model", "tiny-random"], services=SERVICES) == 2
    assert (
        capsys.readouterr().err == f"pdserve {argv[0]}: {argv[-1]} {path}: cannot be read (No such file or directory)\n"
    )


SLOS = ["--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]


@pytest.mark.parametrize(
    ("flag", "argv"),
    [
        ("--profile", ["plan", "--rate", "1", "--input-len", "8", "--output-len", "8", "--workers", "2"]),
        ("--trace", ["plan", "--profile", "PROFILE", "--workers", "2"]),
        ("--profile", ["autoscale", "--addr", "127.0.0.1:1", "--max-workers", "4", "--once"]),
    ],
)
def test_a_profile_or_trace_that_is_not_there_is_refused_naming_the_flag(tmp_path, capsys, flag, argv):
    """It said only open's `[Errno 2] No such file or directory: 'p.json'`, naming no flag."""
    profile, missing = tmp_path / "profile.json", tmp_path / "none.json"
    synthetic_profile().save(profile)
    argv = [str(profile) if a == "PROFILE" else a for a in argv]
    assert cli.main([*argv, flag, str(missing), *SLOS]) == 2
    said = f"pdserve {argv[0]}: {flag} {missing}: cannot be read (No such file or directory)\n"
    assert capsys.readouterr().err == said
