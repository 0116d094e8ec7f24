"""The reaper of a local Ray, without Ray: a launcher process marks the processes it starts (as `pdserve up` marks
Ray's) and is SIGKILLed; the marked ones die with it, whatever session they run in, and nothing else does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from unittest import mock

import pytest

from pdserve.cluster.local_process import alive
from pdserve.cluster.ray_reaper import RayReaper
from pdserve.env import LOCAL_RAY_MARK_VAR

GONE_WITHIN_S = 10.0  # the reaper takes milliseconds; a marked `sleep` left alone would live 600 s

# Starts its reaper, then, marked in their environment: a sleeper, and one in a session of its own behind a shell that
# exits (an orphan, as Ray's workers are once their raylet died); marked by writing to a file in the session's
# directory (argv[1]), as a Ray process that retitled itself is: one more; unmarked: one more, one started before the
# reaper that writes to the session's directory too, and one that reads a log there. Prints the pids, then waits.
# The session's directory is told to the reaper (argv[2] "tell", as `pdserve up` does once Ray started), or
# ("learn") only named for a second on the command line of a marked process, as Ray's GCS names it while Ray starts.
LAUNCHER = """
import subprocess, sys, time
from pdserve.cluster.ray_reaper import RayReaper
session, how = sys.argv[1:]
older = subprocess.Popen(["sleep", "600"], stdout=open(session + "/older.out", "w"))
time.sleep(0.05)  # a clock tick (/proc's start times count them) before the reaper's start
reaper = RayReaper()
with reaper.marking():
    marked = subprocess.Popen(["sleep", "600"])
    shell = subprocess.Popen(["sh", "-c", "setsid sleep 600 & echo $!"], stdout=subprocess.PIPE, text=True)
    orphan = int(shell.stdout.readline())
    if how == "learn":
        subprocess.run([sys.executable, "-c", "import time; time.sleep(1)", "--session-dir=" + session])
if how == "tell":
    reaper.watch_session(session)
elif how == "parent":  # not one session's directory: what writes under it may be another Ray's
    reaper.watch_session(session.rsplit("/", 1)[0])
logging = subprocess.Popen(["sleep", "600"], stdout=open(session + "/worker.out", "w"))
unmarked = subprocess.Popen(["sleep", "600"])
reader = subprocess.Popen(["sleep", "600"], stdin=open(session + "/worker.out"))
print(reaper.process.pid, marked.pid, orphan, logging.pid, unmarked.pid, older.pid, reader.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def launched(request, tmp_path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    how = getattr(request, "param", "tell")
    session = tmp_path / "session_2026-12-06_10-00-00_000000_4242"  # as Ray names one
    session.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(session), how], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert launcher.stdout is not None
    pids = [int(pid) for pid in launcher.stdout.readline().split()]
    try:
        yield launcher, pids
    finally:
        for pid in [launcher.pid, *pids]:  # this test's own processes alone, whatever the assertions found
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("launched", ["tell", "learn"], indirect=True)
def test_a_sigkilled_launcher_takes_what_it_marked_with_it(launched) -> None:
    launcher, (reaper, marked, orphan, logging, unmarked, older, reader) = launched
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert wait_gone([marked, orphan, logging, reaper]) == []
    assert alive(unmarked) and alive(older) and alive(reader)


@pytest.mark.parametrize("launched", ["parent"], indirect=True)
def test_a_directory_that_is_no_session_marks_nothing(launched) -> None:
    launcher, (reaper, marked, _, logging, *_) = launched
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert wait_gone([marked, reaper]) == []
    assert alive(logging)


def test_a_sigkilled_process_group_leaves_the_reaper_to_sweep_the_rest(launched) -> None:
    """A CI job's timeout kills the job's process group: the reaper, in a session of its own, is not in it, and the
    marked orphan in another session is the reaper's to kill (Ray's workers run in process groups of their own)."""
    launcher, (reaper, _, orphan, *_) = launched
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert wait_gone([orphan, reaper]) == []


@mock.patch.dict(os.environ)  # as it was, should `marking` fail to restore it
def test_a_clean_close_sweeps_and_ends_the_reaper_and_unmarks_the_environment() -> None:
    reaper = RayReaper()
    with reaper.marking():
        assert os.environ[LOCAL_RAY_MARK_VAR] == reaper.mark
        left_running = subprocess.Popen(["sleep", "600"])
    assert LOCAL_RAY_MARK_VAR not in os.environ
    try:
        reaper.close()
        assert reaper.process.returncode == 0
        assert left_running.wait(timeout=GONE_WITHIN_S) == -signal.SIGKILL
    finally:
        if left_running.poll() is None:
            left_running.kill()
