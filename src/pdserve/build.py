"""Which build of pdserve a process runs, and the Ray resource that places a worker on a node of that build.

A rollout compares builds as it compares flags: a controller started from a new image (or new code) rolls the
workers it adopts, which still run the old one. The build is PDSERVE_BUILD where the deployment names it (the
chart: the image reference and a digest of the values its worker pods are made of) and otherwise the package
version with a digest of its source, so a code change without a version bump is a new build too. A worker reports
the build it runs, so an operator sees a rollout's progress and any worker left on an old node.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from pdserve import __version__, env

PACKAGE_DIR = Path(__file__).resolve().parent
DIGEST_CHARS = 12


@functools.cache
def current_build() -> str:
    return env.build() or f"pdserve {__version__}+{source_digest()}"


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 over the package's Python sources and their paths: the same tree gives the same digest anywhere."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        h.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:DIGEST_CHARS]


def build_resource(build: str) -> str:
    """The Ray custom resource nodes of `build` advertise (the chart's worker pods: `pdserve_build_` and the first
    12 hex digits of the sha256 of their PDSERVE_BUILD)."""
    return "pdserve_build_" + hashlib.sha256(build.encode()).hexdigest()[:DIGEST_CHARS]
