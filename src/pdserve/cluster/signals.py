"""SIGTERM to a worker process drains it.

Ray runs an actor's code on its process's main thread, blocked in Ray's task loop between calls, and a Python
signal handler runs only when that thread next runs Python: an idle worker would hear of its SIGTERM late or never.
The wakeup fd, though, is written by the C-level handler at once, so a thread reading it acts at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def on_sigterm(act: Callable[[], None]) -> bool:
    """Calls `act` on a thread of its own at the first SIGTERM (instead of the process's default, or Ray's, which
    exit). Only the main thread may set this up; False elsewhere, said in a warning."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("SIGTERM keeps its default here: only the main thread may handle signals")
        return False
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # installs the C handler that writes the fd
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_wait, args=(reader, writer, act), name="sigterm", daemon=True).start()
    return True


def _wait(reader: socket.socket, writer: socket.socket, act: Callable[[], None]) -> None:
    """`writer` is held here so it stays open as long as the fd is the wakeup fd."""
    while signal.SIGTERM.value not in (data := reader.recv(64)):
        if not data:
            return
    log.warning("SIGTERM received: draining")
    act()
