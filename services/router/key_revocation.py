"""A revoked API key's open streams end with it: when a reload of the key file (key_reload.py) no longer holds a
key, or holds it for another tenant, every stream it opened ends at once, UNAUTHENTICATED (HTTP 401), rather than
generating to its end for a caller the cluster no longer knows.

Each request holds its key from its key check to its end (`KeyedStreams.held`). A stream in a decode call has that
call cancelled, which frees its KV blocks and decode slot on the workers as a caller's cancel does; the relay then
ends it with `KeyRevokedError`. One not in a call (being admitted, or moving to other workers) ends before its next
call is made. A key revoked between a request's key check and its hold (the HTTP API checks the key before reading
the body) is refused at the hold.

UNAUTHENTICATED rather than PERMISSION_DENIED: the stream was not asking for more than its key allowed; its key no
longer names a caller at all, which is what UNAUTHENTICATED says (gRPC reserves PERMISSION_DENIED for a caller it
knows). It is the status the key's next request gets, and what makes a client fetch a new key.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.errors import UnauthenticatedError
from pdserve.security.api_keys import KeyTable, Tenant


class KeyRevokedError(UnauthenticatedError):
    """The request's key was revoked while it ran. Its text says so, never the key (nor its name: a caller holding
    the key already knows which it sent)."""

    def __init__(self, tokens_sent: int | None = None) -> None:
        ended = "" if tokens_sent is None else f"; its stream was ended after {tokens_sent} tokens"
        super().__init__(f"this request's API key was revoked (the router's key file no longer holds it){ended}")


class KeyedStream:
    """One request's hold on its key: whether it was revoked, and the decode call to cancel when it is."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.revoked = False
        self.call: grpc.aio.UnaryStreamCall | None = None  # the decode call being relayed, if any

    def check(self, tokens_sent: int) -> None:
        """KeyRevokedError once revoked: before each decode call (its first, or a move's)."""
        if self.revoked:
            raise KeyRevokedError(tokens_sent)

    def revoke(self) -> None:
        self.revoked = True
        if self.call is not None:
            self.call.cancel()  # its read in the relay ends now, and the decode worker frees the sequence


class KeyedStreams:
    """The router's requests, each under the key it was authenticated with, from its key check to its end."""

    def __init__(self) -> None:
        self._open: set[KeyedStream] = set()

    def __len__(self) -> int:
        return len(self._open)

    @contextmanager
    def held(self, tenant: Tenant, keys: KeyTable | None) -> Iterator[KeyedStream]:
        """Holds `tenant`'s key for the request's life; KeyRevokedError when `keys`, the table in use, no longer
        grants it (None: an open cluster, whose requests no reload revokes)."""
        if keys is not None and not keys.grants(tenant):
            raise KeyRevokedError()
        stream = KeyedStream(tenant)
        self._open.add(stream)
        try:
            yield stream
        finally:
            self._open.discard(stream)

    def revoke(self, keys: KeyTable) -> list[Tenant]:
        """Ends the streams of every key `keys` no longer grants; the tenants they were opened as, one per stream."""
        ended = [s for s in self._open if not s.revoked and not keys.grants(s.tenant)]
        for stream in ended:
            stream.revoke()
        return [s.tenant for s in ended]
