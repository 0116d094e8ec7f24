"""What can be checked of the image without building it (no Docker daemon here): a pinned base, the CUDA torch
at pyproject's version, the project installed, a non-root user, `pdserve` as the entrypoint, `make image`."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import yaml

from pdserve import __version__
from tests.deploy.chart import CHART, REPO  # paths only: these checks need no helm


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in (REPO / "Dockerfile").read_text().splitlines()
                                            if not line.lstrip().startswith("#")))  # fmt: skip
    pairs = [line.strip().split(None, 1) for line in text.splitlines() if line.strip()]
    return [(p[0].upper(), p[1] if len(p) > 1 else "") for p in pairs]


def of(kind: str) -> list[str]:
    return [args for k, args in instructions() if k == kind]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_image_is_a_pinned_cuda_runtime() -> None:
    (base,) = of("FROM")
    image = base.split()[0]
    assert "@sha256:" in image or re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), image
    assert image.startswith("nvidia/cuda:") and "runtime" in image


def test_cuda_torch_at_the_projects_pin_then_the_project() -> None:
    (pin,) = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch")]
    args = dict(a.split("=", 1) for a in of("ARG"))
    assert f"torch=={args['TORCH_VERSION']}" == pin
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    runs = of("RUN")
    torch_step = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_step = next(i for i, r in enumerate(runs) if re.search(r"pip install .*/tmp/pdserve-src(\s|$)", r))
    assert torch_step < project_step
    assert "--index-url" in runs[torch_step]


def test_runs_as_non_root_with_pdserve_as_entrypoint() -> None:
    user = of("USER")[-1].split(":")[0]
    assert user not in ("root", "0")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(user) == values["podSecurityContext"]["runAsUser"]
    assert any(f"useradd --uid {user}" in r for r in of("RUN"))
    (entrypoint,) = of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["pdserve"]
    assert "pdserve" in pyproject()["project"]["scripts"]


def test_make_image_builds_it_and_the_chart_runs_that_version() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^image:\n\tdocker build -t \$\(IMAGE\) \.$", makefile, re.M)
    printed = subprocess.run(["make", "-s", "-n", "image"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert printed.stdout.strip() == f"docker build -t pdserve:{__version__} .", printed
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git"} <= set(ignored)


def test_the_image_builds_from_every_file_the_build_reads() -> None:
    """The packages, pyproject's readme and its license files: one not copied in is missing from the installed
    package (setuptools only warns that `license-files` matched nothing, and builds on)."""
    project = pyproject()["project"]
    needed = {"pyproject.toml", project["readme"], *project["license-files"]}
    needed |= set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    copied = {source for args in of("COPY") for source in args.split()[:-1]}
    assert sorted(needed - copied) == []
    assert not needed & set((REPO / ".dockerignore").read_text().split())
