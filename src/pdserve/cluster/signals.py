"""SIGTERM to a worker process drains it.

In a process of its own the handler is installed as usual. A Ray actor cannot: Ray's worker owns the main thread
(the only one `signal.signal` accepts) and runs an async actor's code (WorkerRuntime has coroutines) on another;
its main thread runs Ray's task loop, which runs Python's pending signal handlers every few milliseconds, and the
handler Ray installed there exits the process. So the actor retargets that handler: the function object Ray
registered keeps its place but runs ours. Python lets a function's code be replaced; Ray's handler is a plain
function without a closure, and should that change, the worker says so and SIGTERM keeps Ray's meaning (exit, and
Ray or the supervisor restarts the worker without a drain).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


def on_sigterm(act: Callable[[], None]) -> bool:
    """Calls `act` on a thread of its own at the first SIGTERM instead of exiting; False, with a warning, when the
    process's SIGTERM handler could not be taken over."""
    fired = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        if not fired.is_set():
            fired.set()
            log.warning("SIGTERM received: draining")
            threading.Thread(target=act, name="sigterm-drain", daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        return True
    installed = signal.getsignal(signal.SIGTERM)
    try:
        installed.__code__ = _forward.__code__  # type: ignore[union-attr]
        installed.__defaults__ = (handler,)  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError) as e:
        log.warning("SIGTERM keeps its default meaning here (exit, no drain): its handler %r: %r", installed, e)
        return False
    return True


def _forward(signum: int, frame: FrameType | None, to: Any = None) -> None:
    """The code a taken-over handler runs: `to` is bound as its default, so this code reads no globals."""
    to(signum, frame)
