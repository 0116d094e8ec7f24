"""The local Ray that `pdserve up` starts ends with it, however it ends: a SIGKILL (an OOM kill, a CI job's timeout)
included.

Ray ties what `ray.init` starts to its driver (PR_SET_PDEATHSIG: GCS, raylet, log monitor, dashboard die at once)
and the rest to the raylet: its workers exit about 2 s after it, but its two agents (dashboard, runtime env) each
report the raylet's death to the GCS that died with it and wait out that call's 60 s before they exit, the runtime
env agent holding a port meanwhile (measured: 61-70 s after a SIGKILLed driver, Ray 2.60). A SIGKILL cannot be
caught, so the cleanup runs in a process of its own, started before Ray: the reaper, in a session of its own (a
terminal's Ctrl-C and a kill of the launcher's process group leave it be), blocks on a pipe that only the launcher
holds open. When the pipe ends (the launcher exited, however), it SIGKILLs every process of this user marked as
the local Ray's (`Marks`: younger than the reaper, and marked by the launcher or by Ray's session), and exits.
Only a local Ray's: a joined Ray cluster (`--ray-address`, KubeRay) outlives its drivers by design, its detached
workers with it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve import env

SWEEP_S = 5.0  # a process SIGKILLed is gone within milliseconds; this bounds a sweep that finds one that is not
CLOSE_WAIT_S = 10.0
LEARN_EVERY_S = 0.1  # while Ray starts: the GCS starts seconds before the agents, which soon blank their environment
SESSION_ARGUMENT = re.compile(rb"--session[-_]dir=(.+)")
log = logging.getLogger(__name__)


class RayReaper:
    """The reaper of one local Ray: `marking()` around `ray.init`, `watch_session()` after it, `close()` after
    `ray.shutdown()`."""

    def __init__(self) -> None:
        self.mark = secrets.token_hex(16)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, self.mark, str(os.getpid())],
            stdin=subprocess.PIPE,  # its write end stays here alone (not inheritable: close-on-exec)
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            env=env.inherited_with({"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}),  # this very pdserve
        )

    def marking(self) -> AbstractContextManager[None]:
        """The mark in this process's environment, which the processes Ray starts meanwhile inherit."""
        return env.local_ray_mark(self.mark)

    def watch_session(self, session_dir: str) -> None:
        """Tells the reaper the Ray session's directory (`Marks`), once Ray started."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"{session_dir}\n".encode())
            self.process.stdin.flush()
        except OSError as e:  # it was killed: only a SIGKILL of this process would miss it
            log.warning("the local Ray's reaper is gone (%r): a SIGKILL of this process would leave Ray's agents", e)

    def close(self) -> None:
        """After a clean stop: the reaper sweeps what is left (normally nothing) and exits."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass(frozen=True)
class Marks:
    """What marks a process as the local Ray's. It started no earlier than the reaper (which starts before Ray), so
    nothing that ran before, the launcher and its shell included, is ever taken for one; and it has `variable` in
    its environment (set while Ray starts, so every process it starts then, and theirs, inherit it; but Python's
    setproctitle, which Ray's agents retitle themselves with, blanks the environment /proc shows), or it writes to a
    file under `session_dir` (every Ray process writes its logs there, and whatever it starts inherits them; a reader
    of those logs, `tail -f`, holds them open for reading only)."""

    variable: bytes
    not_before: int  # the reaper's start, in clock ticks since boot (/proc/PID/stat's starttime)
    session_dir: str | None = None

    def on(self, pid: int) -> bool:
        """OSError for another user's process, or one gone meanwhile."""
        if started(pid) < self.not_before:
            return False
        return self.inherited(pid) or (self.session_dir is not None and _writes_under(pid, self.session_dir))

    def inherited(self, pid: int) -> bool:
        """Whether `variable` is in the environment of `pid` as /proc shows it."""
        return self.variable in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def named_session(marks: Marks) -> str | None:
    """The session directory that a Ray process with the launcher's mark names on its command line (the GCS, Ray's
    first process: `--session-dir`; the raylet: `--session_dir`), while one runs."""
    for pid in _pids():
        try:
            if started(pid) < marks.not_before or not marks.inherited(pid):
                continue
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # another user's, or gone
            continue
        for argument in arguments:
            if named := SESSION_ARGUMENT.fullmatch(argument):
                return one_session(named.group(1).decode(errors="replace"))
    return None


def one_session(directory: str) -> str | None:
    """`directory` if it is one Ray session's (`.../session_<time>_<pid>`), else None: what writes under a parent
    of it (`/tmp/ray`) may be another Ray's, which the reaper must never take for its own."""
    name = Path(directory).name
    return directory if name.startswith("session_") and name != "session_latest" else None


def _writes_under(pid: int, directory: str) -> bool:
    """Whether `pid` holds a file under `directory` open for writing (a reader of it, `tail -f`, does not)."""
    inside = f"{directory.rstrip('/')}/"
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(inside) and _for_writing(pid, fd):
                return True
        except FileNotFoundError:  # closed meanwhile
            continue
    return False


def _for_writing(pid: int, fd: str) -> bool:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8) & (os.O_WRONLY | os.O_RDWR) != 0
    return False


def started(pid: int) -> int:
    """When `pid` started, in clock ticks since boot."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])


def sweep(marks: Marks) -> dict[int, str]:
    """SIGKILLs every process of this user (another's cannot be read) with `marks`, until none is left or SWEEP_S
    passed: pid -> name of those killed."""
    killed: dict[int, str] = {}
    deadline = time.monotonic() + SWEEP_S
    while True:
        found = {pid: name for pid in _pids() if (name := _kill_if_marked(pid, marks))}
        killed.update(found)
        if not found or time.monotonic() > deadline:
            return killed
        time.sleep(0.05)  # one killed is still exiting (its marks readable): it is found, and killed, again


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _kill_if_marked(pid: int, marks: Marks) -> str | None:
    """The process's name if it had `marks` and was sent SIGKILL. It is held by a pidfd before its marks are read,
    so a pid reused meanwhile is never the one signalled."""
    if pid == os.getpid():
        return None
    try:
        handle = os.pidfd_open(pid)
    except OSError:  # gone
        return None
    try:
        if not marks.on(pid):  # a zombie has neither mark: it is gone already
            return None
        name = Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")).name
        signal.pidfd_send_signal(handle, signal.SIGKILL)
        return name
    except OSError:  # another user's, or gone meanwhile
        return None
    finally:
        os.close(handle)


def watch(marks: Marks) -> Marks:
    """Reads the launcher's pipe until it ends (the launcher closed it or exited); `marks` with the session's
    directory as the launcher told it once Ray started or, until then, as the first of Ray's processes names it
    (looked for every LEARN_EVERY_S), so a launcher killed while Ray starts leaves none of Ray's agents either."""
    pipe, told = sys.stdin.fileno(), b""
    while True:
        if not select.select([pipe], [], [], None if marks.session_dir else LEARN_EVERY_S)[0]:
            marks = replace(marks, session_dir=named_session(marks))
            continue
        if not (chunk := os.read(pipe, 4096)):
            return marks if marks.session_dir else replace(marks, session_dir=named_session(marks))
        *lines, told = (told + chunk).split(b"\n")
        for line in lines:
            marks = replace(marks, session_dir=one_session(line.decode()))


def main(mark: str, launcher: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to handle; the pipe says when it ended
    marks = watch(Marks(f"{env.LOCAL_RAY_MARK_VAR}={mark}".encode(), started(os.getpid())))
    if killed := sweep(marks):
        print(
            f"pdserve up (pid {launcher}) ended: killed the {len(killed)} processes of its local Ray still running "
            f"({', '.join(sorted(set(killed.values())))})",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
