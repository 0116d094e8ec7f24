"""The build a process reports and rolls on: the deployment's name for it, else the version and a source digest
that moves with any code change; the Ray resource named after it; and that a controller's build never reaches
the workers it launches (theirs is their node's)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from pdserve import __version__, build, cli, env


@pytest.fixture
def fresh_build():
    build.current_build.cache_clear()
    yield build.current_build
    build.current_build.cache_clear()


def test_the_deployments_name_for_the_build_wins(monkeypatch: pytest.MonkeyPatch, fresh_build) -> None:
    monkeypatch.setenv("PDSERVE_BUILD", "registry.example/pdserve:1.4.2")
    assert fresh_build() == "registry.example/pdserve:1.4.2"


def test_an_unnamed_build_is_the_version_and_the_sources_digest(monkeypatch: pytest.MonkeyPatch, fresh_build) -> None:
    monkeypatch.delenv("PDSERVE_BUILD", raising=False)
    assert re.fullmatch(rf"pdserve {re.escape(__version__)}\+[0-9a-f]{{12}}", fresh_build())
    assert fresh_build().endswith(build.source_digest())


def test_the_digest_moves_with_any_source_change_and_only_then(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "sub" / "b.py").write_text("B = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    first = build.source_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not code")
    assert build.source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("B = 3\n")
    edited = build.source_digest(tmp_path)
    assert edited != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b.py")  # the same bytes elsewhere: another tree
    assert build.source_digest(tmp_path) != edited


def test_the_build_resource_is_the_sha256_of_the_build_as_the_chart_computes_it() -> None:
    image = "ghcr.io/example/pdserve:0.1.0"
    assert build.build_resource(image) == "pdserve_build_" + hashlib.sha256(image.encode()).hexdigest()[:12]
    assert build.build_resource(image) != build.build_resource("ghcr.io/example/pdserve:0.1.1")


def test_launched_workers_never_inherit_the_launchers_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_BUILD", "img:new")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/models")
    assert env.worker_env().get("PDSERVE_CACHE_DIR") == "/models"
    assert "PDSERVE_BUILD" not in env.worker_env()


def test_secrets_never_go_through_rays_runtime_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's runtime-env agent logs the env it makes (and its GCS keeps it): workers get secrets otherwise."""
    secrets = ["PDSERVE_CLUSTER_SECRET", "PDSERVE_REDIS_PASSWORD", "PDSERVE_API_KEY", "OTEL_EXPORTER_OTLP_HEADERS"]
    secrets.append("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
    for name in secrets:
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    passed = env.worker_env()
    assert not set(secrets) & set(passed) and passed["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"


def test_pdserve_version_prints_the_version_and_the_build(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fresh_build
) -> None:
    """What an operator runs in a pod to see what it holds: the package version, and the build its processes
    report (the chart's PDSERVE_BUILD there), before any command's required flags are asked for."""
    monkeypatch.setenv("PDSERVE_BUILD", "registry.example/pdserve:1.4.2")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"pdserve {__version__} (build registry.example/pdserve:1.4.2)\n"
