"""Building a built-in model into the cache: complete or rebuilt, readable by other users, never two builds at once,
and nothing left behind by a build that was killed. Builders here are fakes writing a few small files (no
download): what is under test is the cache around them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine.cache_manifest import MANIFEST
from pdserve.engine.model_cache import OWNER_FILE, STALE_AFTER_S, ModelFetchError, build_cached
from pdserve.engine.model_files import ModelNotFetchedError, builtin_folder, is_built, locate_model

NAME = "tiny-random"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path / "models"


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


class FakeBuilder:
    """Writes what a model folder needs, safetensors' way (mode 0600); counts its builds and where it worked."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.builds, self.seconds, self.scratch = 0, seconds, Path()

    def __call__(self, folder: Path, scratch: Path, stage: object) -> None:
        self.builds += 1
        self.scratch = scratch
        (scratch / "wheel.whl").write_bytes(b"a download")
        time.sleep(self.seconds)
        save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
        (folder / "tokenizer.json").write_text("{}")
        (folder / "config.json").write_text(json.dumps({"builds": self.builds}))


def test_built_files_are_readable_by_other_users(cache: Path, umask_022: None) -> None:
    """safetensors writes 0600 whatever the umask: a cache an image baked as root was unreadable by uid 1000."""
    folder = build_cached(NAME, FakeBuilder())
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes == dict.fromkeys(["model.safetensors", "tokenizer.json", "config.json", MANIFEST], 0o644)
    assert folder.stat().st_mode & 0o777 == 0o755


def test_the_umask_still_narrows_them(cache: Path) -> None:
    old = os.umask(0o027)
    try:
        folder = build_cached(NAME, FakeBuilder())
    finally:
        os.umask(old)
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o640}


def test_a_cut_file_makes_the_folder_incomplete_and_the_next_build_replaces_it(cache: Path) -> None:
    build = FakeBuilder()
    folder = build_cached(NAME, build)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert not is_built(folder)
    with pytest.raises(ModelNotFetchedError, match=r"incomplete \(model.safetensors is \d+ bytes, its build wrote"):
        locate_model(NAME)
    assert build_cached(NAME, build) == folder and build.builds == 2
    assert is_built(folder) and json.loads((folder / "config.json").read_text()) == {"builds": 2}


def test_a_folder_without_its_config_is_rebuilt_not_a_rename_failure(cache: Path) -> None:
    """It made every fetch convert again and then fail: "Directory not empty"."""
    folder = builtin_folder(NAME)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half")
    assert build_cached(NAME, FakeBuilder()) == folder and is_built(folder)
    assert sorted(p.name for p in cache.iterdir()) == [f".{NAME}.lock", NAME]  # the bad folder went too


def test_a_folder_built_before_the_manifest_still_counts(cache: Path) -> None:
    folder = builtin_folder(NAME)
    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text("{}")
    build = FakeBuilder()
    assert build_cached(NAME, build) == folder and build.builds == 0
    (folder / "tokenizer.json").unlink()
    assert not is_built(folder)


def test_force_rebuilds_a_complete_folder(cache: Path) -> None:
    build = FakeBuilder()
    build_cached(NAME, build)
    build_cached(NAME, build, force=True)
    assert build.builds == 2 and json.loads((builtin_folder(NAME) / "config.json").read_text()) == {"builds": 2}


def test_the_download_is_in_the_staging_folder_and_goes_with_it(cache: Path) -> None:
    """It was left in TMPDIR (183 MB for smollm2) when a fetch was killed."""
    build = FakeBuilder()
    build_cached(NAME, build)
    assert build.scratch.parent.parent == cache and build.scratch.parent.name.startswith(f".{NAME}-")
    assert not build.scratch.parent.exists()


def staging(cache: Path, suffix: str, owner: dict | None, age_s: float = 0.0) -> Path:
    path = cache / f".{NAME}-{suffix}"
    path.mkdir(parents=True)
    if owner is not None:
        (path / OWNER_FILE).write_text(json.dumps({"model": NAME, **owner}))
    (path / "model").mkdir()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_staging_folders_whose_owner_is_gone_are_removed(cache: Path) -> None:
    """Each killed fetch left one (0.5 GB for smollm2). A pid is only trusted on its own host, and not for long."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here, old = socket.gethostname(), STALE_AFTER_S + 60
    removed = [
        staging(cache, "dead", {"host": here, "pid": dead.pid}),
        staging(cache, "reused", {"host": here, "pid": os.getpid()}, age_s=old),
        staging(cache, "far-old", {"host": "elsewhere", "pid": 1}, age_s=old),
        staging(cache, "ownerless-old", None, age_s=old),
    ]
    kept = [
        staging(cache, "alive", {"host": here, "pid": os.getpid()}),
        staging(cache, "far-young", {"host": "elsewhere", "pid": 1}),
        staging(cache, "ownerless-young", None),
    ]
    build_cached(NAME, FakeBuilder())
    assert [p.exists() for p in removed] == [False] * 4
    assert [p.exists() for p in kept] == [True] * 3


def test_concurrent_builds_build_once_and_the_others_wait(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Four workers starting at once each downloaded and converted the model (90 s each instead of 25 s)."""
    build = FakeBuilder(seconds=0.5)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build_cached(NAME, build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.builds == 1 and results == [builtin_folder(NAME)] * 4
    assert "waiting for another process to finish building tiny-random" in caplog.text


@pytest.mark.parametrize("where", ["/sys/pdserve-cache", "no home"])
def test_a_cache_that_cannot_be_written_is_a_fetch_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    if where == "no home":
        monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
        monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("Could not determine home")))
    else:
        monkeypatch.setenv("PDSERVE_CACHE_DIR", where)
    with pytest.raises(ModelFetchError, match="set PDSERVE_CACHE_DIR"):
        build_cached(NAME, FakeBuilder())


def test_a_full_disk_is_a_fetch_error_and_leaves_no_staging(cache: Path) -> None:
    from safetensors import SafetensorError

    def full(folder: Path, scratch: Path, stage: object) -> None:
        raise SafetensorError("No space left on device")

    with pytest.raises(ModelFetchError, match="No space left on device"):
        build_cached(NAME, full)
    assert [p.name for p in cache.iterdir()] == [f".{NAME}.lock"]


def test_sigterm_of_a_fetch_removes_its_staging_folder(tmp_path: Path) -> None:
    """Kubernetes stops an init container with SIGTERM, which killed the fetch before its cleanup ran."""
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    fetch = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "fetch", "--model", NAME], env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"models/.{NAME}-*/{OWNER_FILE}")):
        assert fetch.poll() is None and time.monotonic() < deadline, "the fetch never began building"
        time.sleep(0.01)
    fetch.send_signal(signal.SIGTERM)
    assert fetch.wait(timeout=60) == 128 + signal.SIGTERM
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{NAME}.lock"]
