"""The completion manifest of a built-in model's cache folder: written last, it names every file with its size.

A folder renamed into place whole is complete when renamed, but a disk can still cut or lose a file afterwards
(a copy, a restore, a full volume): checking each file's size against the manifest is cheap (no byte is read)
and catches a truncated model.safetensors before a worker fails on it, naming no file. Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "pdserve-manifest.json"
# What a folder built before the manifest existed must hold to count as built (see `problem`).
LEGACY_REQUIRED = ("config.json", "tokenizer.json")


def write_manifest(folder: Path) -> None:
    """Every file of `folder` with its size, each file and then the folder synced first, so that a manifest on
    disk never describes data still in the page cache (a power cut after the rename must not leave it lying)."""
    sizes = {}
    for path in sorted(folder.iterdir()):
        if path.is_file():
            _fsync(path)
            sizes[path.name] = path.stat().st_size
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"version": 1, "files": sizes}, indent=2))
    _fsync(manifest)
    _fsync(folder)


def problem(folder: Path) -> str | None:
    """Why `folder` is not a complete build (None: it is). A folder without a manifest was built before the
    manifest existed: it counts as built when the files every model needs are there (the old build renamed whole
    folders too), so existing caches keep working; damage inside them is named when the file is loaded."""
    if not folder.is_dir():
        return "not built"
    manifest = folder / MANIFEST
    if not manifest.exists():
        missing = [name for name in LEGACY_REQUIRED if not (folder / name).exists()]
        if not any(folder.glob("*.safetensors")):
            missing.append("*.safetensors")
        return f"no {', '.join(missing)}" if missing else None
    try:
        sizes = json.loads(manifest.read_text())["files"]
        expected = {str(name): int(size) for name, size in sizes.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, size in expected.items():
        path = folder / name
        if not path.exists():
            return f"{name} missing"
        if (actual := path.stat().st_size) != size:
            return f"{name} is {actual} bytes, its build wrote {size}"
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
