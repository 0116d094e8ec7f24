"""Building a built-in model into the cache: whole or not at all, readable by every user, once at a time.

A build runs in a staging folder beside its target (`.{name}-XXXXXXXX`, holding the download and the converted
folder: one place to clean) while it holds `models/.{name}.lock`, so that four workers starting at once build
once and the other three wait for it. The converted folder gets a completion manifest (`cache_manifest`), last,
and is renamed into place. Staging folders a killed build left behind are removed by the next build. Torch-free:
the builders (`pdserve.engine.models`) bring torch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from pdserve.engine.cache_manifest import write_manifest
from pdserve.engine.model_files import builtin_folder, is_built
from pdserve.progress import stages

# A staging folder older than this whose owner cannot be checked (another host on a shared volume, an older
# pdserve that wrote no owner, a pid that may have been reused) is abandoned: a build takes under a minute.
STALE_AFTER_S = 3600.0
OWNER_FILE = "owner.json"
Stage = Callable[[str], None]
Builder = Callable[[Path, Path, Stage], None]  # (the model folder to fill, a scratch folder, stage)

_log = logging.getLogger(__name__)


class ModelFetchError(RuntimeError):
    """A built-in model could not be fetched or built; the message says what to do."""


def build_cached(name: str, build: Builder, force: bool = False) -> Path:
    """The built-in model's cache folder, built first when it is not complete (or `force`). A failure of the
    environment (a read-only or full disk, no home for the default cache) is a ModelFetchError naming the
    folder and PDSERVE_CACHE_DIR, not a traceback."""
    try:
        target = builtin_folder(name)
        if not force and is_built(target):
            return target
        with _build_lock(target):
            if not force and is_built(target):  # built by the process this one waited for
                return target
            _remove_abandoned_staging(target)
            _build(target, build)
        return target
    except (OSError, SafetensorError) as e:
        raise ModelFetchError(
            f"could not build {name} in the model cache ({e}); make room there, or set PDSERVE_CACHE_DIR to a "
            "writable folder with space"
        ) from None


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An advisory lock beside the target, held while building; the lock file stays (removing it would let a
    waiter lock a file no newcomer sees)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.warning("waiting for another process to finish building %s into %s", target.name, target.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _build(target: Path, build: Builder) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        owner = {"model": target.name, "host": socket.gethostname(), "pid": os.getpid()}
        (staging / OWNER_FILE).write_text(json.dumps(owner))
        folder, scratch = staging / "model", staging / "download"
        folder.mkdir()
        scratch.mkdir()
        with stages(f"preparing {target.name}") as stage:
            build(folder, scratch, stage)
        _readable_by_all(folder)
        write_manifest(folder)
        if target.exists() or target.is_symlink():  # incomplete, or rebuilt on request: moved aside, removed below
            target.rename(staging / "replaced")
        folder.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _readable_by_all(folder: Path) -> None:
    """Files 0644 and folders 0755 less the umask: safetensors writes 0600 whatever the umask, which left a cache
    built by one user (an image baked as root, a shared volume) unreadable by the user serving it."""
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644 & ~umask)
    folder.chmod(0o755 & ~umask)


def _remove_abandoned_staging(target: Path) -> None:
    """Staging folders of this model that a killed build left (0.5 GB each for smollm2). Called holding the lock,
    so no live build of this pdserve owns one; an older pdserve's or another host's may, hence `_abandoned`."""
    for staging in target.parent.glob(f".{target.name}-*"):
        if staging.is_dir() and _abandoned(staging, target.name):
            _log.warning("removing %s, left by a build that did not finish", staging)
            shutil.rmtree(staging, ignore_errors=True)


def _abandoned(staging: Path, name: str) -> bool:
    """Its owner is gone: a process of this host that no longer runs, or, where that cannot be told (another
    host, no owner file, a pid that may have been reused since), a folder older than STALE_AFTER_S."""
    old = time.time() - staging.stat().st_mtime > STALE_AFTER_S
    try:
        owner = json.loads((staging / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return old
    if not isinstance(owner, dict) or owner.get("model") != name:
        return False  # another model's whose name begins like this one's
    pid = owner.get("pid")
    if owner.get("host") == socket.gethostname() and isinstance(pid, int):
        return old or not _running(pid)
    return old


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, another user's
        return True
    return True
