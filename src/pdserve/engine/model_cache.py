"""Building a built-in model into the cache: whole or not at all, and readable by every user.

A build runs in a staging folder beside its target (`.{name}-XXXXXXXX`, holding the download and the converted
folder: one place to clean). The converted folder gets a completion manifest (`cache_manifest`), last, and is
renamed into place. Torch-free: the builders (`pdserve.engine.models`) bring torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdserve.engine.cache_manifest import write_manifest
from pdserve.engine.model_files import builtin_folder, is_built
from pdserve.progress import stages

Stage = Callable[[str], None]
Builder = Callable[[Path, Path, Stage], None]  # (the model folder to fill, a scratch folder, stage)


class ModelFetchError(RuntimeError):
    """A built-in model could not be fetched or built; the message says what to do."""


def build_cached(name: str, build: Builder, force: bool = False) -> Path:
    """The built-in model's cache folder, built first when it is not complete (or `force`)."""
    target = builtin_folder(name)
    if not force and is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _build(target, build)
    return target


def _build(target: Path, build: Builder) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
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
