"""Progress is drawn on stderr only when stderr is a terminal: a pseudo-terminal gets the bar, a pipe nothing."""

from __future__ import annotations

import os
import pty
import select
import sys
import time

import pytest

from pdserve.progress import counting, stages


def run_work() -> None:
    with counting("requests at 2/s", 3) as advance:
        for _ in range(3):
            time.sleep(0.15)  # long enough for a refresh (rich redraws 10 times a second)
            advance()
    with stages("preparing tiny-random") as stage:
        stage("converting")
        time.sleep(0.15)


def test_a_terminal_gets_the_bar(monkeypatch):
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        run_work()
    drawn = b""
    while chunk := _read_available(leader):
        drawn += chunk
    os.close(leader)
    text = drawn.decode(errors="replace")
    assert "requests at 2/s" in text and "/3" in text
    assert "preparing tiny-random: converting" in text


@pytest.mark.parametrize("stream", ["pipe", "file"])
def test_anything_else_gets_nothing(monkeypatch, stream, tmp_path):
    if stream == "pipe":
        read_end, write_end = os.pipe()
        out = os.fdopen(write_end, "w")
    else:
        out = open(tmp_path / "log", "w")  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", out)
    run_work()
    out.close()
    if stream == "pipe":
        with os.fdopen(read_end, "rb") as r:
            assert r.read() == b""
    else:
        assert (tmp_path / "log").read_text() == ""


def _read_available(fd: int) -> bytes:
    ready, _, _ = select.select([fd], [], [], 0.2)
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # the follower side closed: Linux reports EIO once everything is read
        return b""
