"""What `pip install pdserve` gets: pyproject's build backend must be one that reads pyproject's fields."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_build_backend_reads_the_license_fields() -> None:
    """A string `license` (PEP 639) needs setuptools 77: an older one, which a build without isolation uses (a
    distro's, an image's), refuses pyproject.toml ("project.license must be valid exactly by one definition")."""
    project = pyproject()["project"]
    assert isinstance(project["license"], str)
    (backend,) = [Requirement(r) for r in pyproject()["build-system"]["requires"] if r.startswith("setuptools")]
    assert not backend.specifier.contains("76.99"), backend
