"""Files that are rotated in place (a certificate cert-manager renews, an API key file an operator edits, both
mounted from a Kubernetes Secret), read again when their contents change, so that no restart is needed.

Contents, not timestamps, are compared: the kubelet swaps a Secret's files by repointing a `..data` symlink,
which a stat of the path may not show, and two writes within one mtime tick look the same. The files are small
(a PEM or a TOML table), so reading them at most once per `interval_s` costs nothing, even when asked on every
TLS handshake.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

Contents = tuple[bytes, ...]  # each file's bytes, in the order of its path
POLL_INTERVAL_S = 1.0


def read_all(paths: Sequence[str]) -> Contents:
    """The files' bytes (OSError when one cannot be read)."""
    return tuple(Path(p).read_bytes() for p in paths)


class WatchedFiles:
    """The contents of `paths`, handed out once per change. Safe to call from several threads: gRPC asks for a
    certificate from its own."""

    def __init__(
        self,
        paths: Sequence[str],
        interval_s: float = POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths = tuple(paths)
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.initial = read_all(self.paths)  # a file missing at start is the caller's error, raised
        self._seen: Contents | OSError = self.initial
        self._checked_at = clock()

    def changed(self) -> Contents | OSError | None:
        """The files' contents when they differ from what the last call saw (an OSError when one cannot be read:
        a file being replaced), None when they do not or when the last look is under `interval_s` old. Each
        change is handed out once, so a caller that rejects it (a half-written file) says so once."""
        with self._lock:
            now = self._clock()
            if now - self._checked_at < self._interval_s:
                return None
            self._checked_at = now
            try:
                current: Contents | OSError = read_all(self.paths)
            except OSError as e:
                current = e
            if _same(current, self._seen):
                return None
            self._seen = current
            return current


def _same(a: Contents | OSError, b: Contents | OSError) -> bool:
    if isinstance(a, OSError) or isinstance(b, OSError):
        return isinstance(a, OSError) and isinstance(b, OSError) and str(a) == str(b)
    return a == b
