"""Rotated files read again: each change handed out once, and looked for at most once an interval."""

from __future__ import annotations

from pathlib import Path

from pdserve.security.watched_files import WatchedFiles


def test_each_change_is_handed_out_once_and_not_looked_for_more_than_once_an_interval(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "f"
    path.write_bytes(b"a")
    files = WatchedFiles([str(path)], interval_s=1.0, clock=lambda: now[0])
    assert files.initial == (b"a",)
    path.write_bytes(b"b")
    assert files.changed() is None  # under an interval since the last look
    now[0] += 1
    assert files.changed() == (b"b",)
    now[0] += 1
    assert files.changed() is None  # the same change is not handed out twice
    path.unlink()
    now[0] += 1
    assert isinstance(files.changed(), OSError)
    now[0] += 1
    assert files.changed() is None
    path.write_bytes(b"b")  # back as it was: a change from the unreadable file
    now[0] += 1
    assert files.changed() == (b"b",)
