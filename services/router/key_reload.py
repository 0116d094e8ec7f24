"""The router's API keys, read again when the `--api-keys` file changes (an operator adding or revoking a key in
a Kubernetes Secret), so that no restart drops the streams in flight.

The file is looked at every `interval_s` on the router's loop. A file that parses swaps the whole table at once:
the next request is checked against the new table (a revoked key's is UNAUTHENTICATED), a request in flight keeps
the tenant it was given while the new table still holds its key for that tenant, and ends, UNAUTHENTICATED, when it
does not (key_revocation.py). One that does not parse leaves the table in use, with one error naming the problem,
until the file changes again.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.background import cancel_and_wait
from pdserve.security.api_keys import KeyTable
from pdserve.security.watched_files import POLL_INTERVAL_S, WatchedFiles
from services.router.lifecycle import RequestLifecycle
from services.router.outcome import tenant_labels

log = logging.getLogger(__name__)


class KeyReload:
    """`table`: the keys as the file held them at start (ValueError when they do not parse: the start fails)."""

    def __init__(self, path: str, interval_s: float = POLL_INTERVAL_S) -> None:
        self.path = path
        self._interval_s = interval_s
        self._file = WatchedFiles([path], interval_s=0)  # the task paces the looks
        self.table = KeyTable.parse(self._file.initial[0], path)
        self._task: asyncio.Task[None] | None = None

    def start(self, lifecycle: RequestLifecycle) -> None:
        """Keeps `lifecycle`'s keys, its quotas' per-key counts and its tenants' weights as the file says, until
        `close`."""
        self._task = asyncio.get_running_loop().create_task(self._watch(lifecycle), name="api-key-reload")

    async def _watch(self, lifecycle: RequestLifecycle) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.reload(lifecycle)
            except Exception:  # a bug here must not end reloads for good, nor come out of the router's stop
                log.exception("API keys: reload failed; the keys in use stay")

    def reload(self, lifecycle: RequestLifecycle) -> None:
        change = self._file.changed()
        if change is None:
            return
        try:
            if isinstance(change, OSError):
                raise ValueError(f"{self.path}: cannot be read ({change.strerror})")
            table = KeyTable.parse(change[0], self.path)
        except ValueError as e:
            log.error("API keys not reloaded, the %d keys in use stay: %s", len(self.table), e)
            return
        self.table = lifecycle.keys = table
        ended = lifecycle.relay.keyed.revoke(table)
        lifecycle.quotas.keep_only(table.limits)
        lifecycle.admission.shares.weights = table.weights
        lifecycle.metrics.count_from_zero(tenant_labels(table))  # a new tenant's series from 0 too
        log.info("API keys reloaded: %d keys from %s", len(table), self.path)
        if ended:  # by the keys' names (never the keys), as the key file names them
            names = ", ".join(sorted({repr(t.key_name) for t in ended}))
            log.info("API keys revoked with %d streams open: %s; those streams were ended", len(ended), names)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
