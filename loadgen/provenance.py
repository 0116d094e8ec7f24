"""What code produced a result: pdserve's (loadgen's) version and, in a git checkout, its commit, so that a result
file names the loadgen that measured it. Outside a checkout (an installed wheel) the commit is None, not an error."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pdserve

GIT_TIMEOUT_S = 5.0


def version() -> str:
    """The running code's own version, not an installed distribution's metadata, which an editable install keeps
    from when it was made and a checkout run by PYTHONPATH may not have at all."""
    return pdserve.__version__


@functools.cache  # once per process, not per rate
def git_commit(folder: Path = Path(__file__).parent) -> str | None:
    """The checkout's HEAD, with `-dirty` when its tracked files differ from it; None outside a checkout."""
    try:
        head = _git(folder, "rev-parse", "HEAD")
        dirty = _git(folder, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or git hung
        return None
    return f"{head}-dirty" if dirty else head


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True)
    return done.stdout.strip()
