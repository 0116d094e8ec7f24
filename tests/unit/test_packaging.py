"""What `pip install pdserve` gets, checked on a real build: the sdist made from the files git tracks, then the wheel
made from that sdist (as `python -m build` does), so a file the sdist leaves out is missing from the wheel too.
The wheel must hold every file of the three packages, the license and the console scripts; pyproject's build
backend must be one that reads pyproject's fields; and its dependency floors must be versions the code imports on."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from pdserve import __version__
from tests.docs_pages import relative_links

ROOT = Path(__file__).resolve().parents[2]
# Where each package's files sit in the checkout, and where the wheel puts them (pyproject's package-dir).
PACKAGE_DIRS = {"src/pdserve/": "pdserve/", "services/": "services/", "loadgen/": "loadgen/"}
BUILD_TIMEOUT_S = 120


@dataclass(frozen=True)
class Built:
    sdist: list[str]  # names inside the sdist, less its top folder
    wheel: dict[str, bytes]  # name -> contents


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def tracked_files() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, so no list of the files a release is made of: {e}")
    return [name for name in done.stdout.decode().split("\0") if name]


def _build(backend_call: str, source: Path, out: Path) -> str:
    """Run one setuptools build_meta hook in `source` (it builds the folder it runs in); the file it made."""
    code = f"import sys; from setuptools import build_meta; print(build_meta.{backend_call}(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    assert done.returncode == 0, f"{backend_call} failed:\n{done.stderr[-4000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    work = tmp_path_factory.mktemp("release")
    checkout, out = work / "checkout", work / "dist"
    for name in tracked_files():
        target = checkout / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / name).read_bytes())
    out.mkdir()
    sdist = out / _build("build_sdist", checkout, out)
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "unpacked", filter="data")
        names = [m.name.split("/", 1)[1] for m in archive.getmembers() if m.isfile()]
    (unpacked,) = (work / "unpacked").iterdir()
    with zipfile.ZipFile(out / _build("build_wheel", unpacked, out)) as wheel:
        return Built(sdist=names, wheel={n: wheel.read(n) for n in wheel.namelist()})


def dist_info(built: Built, name: str) -> str:
    (path,) = [n for n in built.wheel if n.endswith(f".dist-info/{name}") and n.count("/") == 1]
    return built.wheel[path].decode()


def test_the_wheel_holds_every_file_of_the_packages(built: Built) -> None:
    """Generated gRPC code, stubs and any data file added beside the code: in the wheel, or a pip install lacks it."""
    expected = {
        installed + name.removeprefix(source)
        for name in tracked_files()
        for source, installed in PACKAGE_DIRS.items()
        if name.startswith(source)
    }
    assert {"pdserve/v1/generate_pb2.py", "pdserve/v1/generate_pb2_grpc.py", "services/main.py"} <= expected
    assert sorted(expected - set(built.wheel)) == []


def test_the_wheel_is_the_version_the_code_reports(built: Built) -> None:
    """One version: the package's metadata (what pip shows) is pdserve.__version__ (what `pdserve --version` and
    the build each process reports say)."""
    assert "version" in pyproject()["project"]["dynamic"] and "version" not in pyproject()["project"]
    assert f"Version: {__version__}" in dist_info(built, "METADATA").splitlines()


def test_the_wheel_and_sdist_carry_the_license(built: Built) -> None:
    (license_file,) = pyproject()["project"]["license-files"]
    text = (ROOT / license_file).read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert license_file in built.sdist
    (in_wheel,) = [n for n in built.wheel if n.endswith(f".dist-info/licenses/{license_file}")]
    assert built.wheel[in_wheel].decode() == text
    metadata = dist_info(built, "METADATA").splitlines()
    assert "License-Expression: Apache-2.0" in metadata and f"License-File: {license_file}" in metadata


def test_the_sdist_carries_the_proto_sources(built: Built) -> None:
    """The source of the generated code, and the API contract a client in another language is built from."""
    protos = [name for name in tracked_files() if name.startswith("protos/") and name.endswith(".proto")]
    assert "protos/pdserve/v1/generate.proto" in protos
    assert sorted(set(protos) - set(built.sdist)) == []


def test_the_sdist_carries_every_page_the_readme_links_to(built: Built) -> None:
    """The README, pyproject's readme, is a front page whose links lead to docs/: an unpacked sdist holds them."""
    linked = {target.partition("#")[0] for target in relative_links(ROOT / "README.md")}
    files = {name for name in linked if name and not name.endswith("/")}  # a folder's link leads to a listing
    assert "docs/architecture.md" in files
    assert sorted(files - set(built.sdist)) == []


def test_the_wheel_installs_both_commands(built: Built) -> None:
    scripts = dist_info(built, "entry_points.txt").split("[console_scripts]\n", 1)[1].split("\n\n")[0]
    assert dict(line.split(" = ") for line in scripts.splitlines()) == pyproject()["project"]["scripts"]
    for target in pyproject()["project"]["scripts"].values():
        module = target.split(":")[0].replace(".", "/")
        assert f"{module}.py" in built.wheel, target


def test_the_build_backend_reads_the_license_fields() -> None:
    """A string `license` and `license-files` (PEP 639) need setuptools 77: an older one, which a build without
    isolation uses (a distro's, an image's), refuses pyproject.toml ("project.license must be valid exactly by
    one definition")."""
    project = pyproject()["project"]
    assert isinstance(project["license"], str) and project["license-files"]
    (backend,) = [Requirement(r) for r in pyproject()["build-system"]["requires"] if r.startswith("setuptools")]
    assert not backend.specifier.contains("76.99"), backend


def floor(requirement: Requirement) -> Version:
    """The oldest version the requirement lets pip install."""
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=", ">")]
    assert bounds, f"{requirement}: no floor"
    return max(bounds)


def test_the_floors_are_what_the_generated_grpc_code_needs() -> None:
    """Each module of src/pdserve/v1 refuses at import a protobuf older than the one that generated it, or a grpcio
    older than its GRPC_GENERATED_VERSION: every install pyproject allows must import them. grpcio-tools, pinned
    at the generating release, once pulled these floors up at run time and so hid them."""
    v1 = ROOT / "src" / "pdserve" / "v1"
    protobuf_call = r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),"
    protobuf = {Version(".".join(m)) for p in v1.glob("*_pb2.py") for m in re.findall(protobuf_call, p.read_text())}
    grpc = {
        Version(m)
        for p in v1.glob("*_pb2_grpc.py")
        for m in re.findall(r"GRPC_GENERATED_VERSION = '(.+)'", p.read_text())
    }
    assert len(protobuf) == len(grpc) == 1, (protobuf, grpc)
    requirements = {r.name: r for r in map(Requirement, pyproject()["project"]["dependencies"])}
    assert floor(requirements["protobuf"]) >= max(protobuf)
    assert floor(requirements["grpcio"]) >= max(grpc)
