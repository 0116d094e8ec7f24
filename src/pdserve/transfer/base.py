"""Interfaces of the KV data plane: the prefill side sends a sequence's blocks, the decode side receives them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

import torch

if TYPE_CHECKING:
    from pdserve.transfer.send_start import SendStart

KVCaches = Sequence[torch.Tensor]  # one cache tensor per layer


class TransferError(RuntimeError):
    """A KV transfer failed; the caller frees the blocks it reserved for it. Nothing writes them afterwards."""


class PeerLostError(TransferError):
    """The other process died or closed the pair; a new rendezvous is needed for the next transfer."""


class TransferTimeoutError(TransferError):
    """The transfer did not complete within its timeout."""


class PeerSilentError(TransferTimeoutError):
    """The other process does not answer (stopped, starved, or cut off): it may resume, and its pair with it."""


class TransferCancelledError(TransferError):
    """The caller cancelled the recv before any byte of it arrived; nothing writes its blocks."""


class NotExpectedError(TransferError):
    """The decode side holds no receive for the tag: it gave up on the transfer (timed out, or its request was
    cancelled) before the send came, or never posted one. That side counts the failure; the sender's is its echo."""


class LayoutMismatchError(TransferError):
    """Both sides disagree on the KV layout (model, dtype, block size, shapes); the message names the fields."""


class _Closeable(ABC):
    """One side of the data plane; closing it (at shutdown, or leaving a `with`) drops every pair group:
    waiting calls fail and later ones raise TransferError."""

    @abstractmethod
    def close(self) -> None:
        """Called at shutdown."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSender(_Closeable):
    """Prefill side. One per prefill worker, shared by its request handlers (thread-safe)."""

    @abstractmethod
    def send(
        self,
        rendezvous: str,
        tag: int,
        kv_caches: KVCaches,
        block_ids: Sequence[int],
        timeout_s: float,
        start: SendStart | None = None,
    ) -> int:
        """Called by the prefill worker once the prompt has run: copies `kv_caches[layer][:, block_ids]`
        (the sequence's blocks, in block-table order) into the decode side's blocks waiting under `tag`.

        `rendezvous` is the decode side's "host:port" for this pair (from `KVReceiver.rendezvous`, carried
        in `KVTarget`); the pair group is built on first use and cached. Returns the bytes moved, once the
        decode side reports the blocks in place; the caller may then free its own blocks. Reads the caches,
        never changes them. Raises TransferError (PeerLostError, TransferTimeoutError, LayoutMismatchError, or
        NotExpectedError: the decode side no longer waits for `tag`, a failure it counts itself) when its turn on
        the pair does not come within `timeout_s`, or its transfer is not done within `timeout_s` of starting (so
        within about twice `timeout_s`); a broken pair group is dropped and rebuilt by a later send. A `start` its
        caller called off before the transfer began raises TransferCancelledError there, without reading the caches.
        """


class KVReceiver(_Closeable):
    """Decode side. One per decode worker, shared by its request handlers (thread-safe)."""

    @abstractmethod
    def rendezvous(self, peer_id: str) -> str:
        """Called by the decode worker before each transfer from prefill worker `peer_id`: returns the
        "host:port" the sender must connect to (goes into `KVTarget.rendezvous`). Creates the pair's store
        and starts building its group in the background when there is no live pair for that peer; cheap
        otherwise. After a pair breaks, the next call returns a new address.
        """

    @abstractmethod
    def recv(self, peer_id: str, tag: int, kv_caches: KVCaches, block_ids: Sequence[int], timeout_s: float) -> int:
        """Called by the decode worker after allocating `block_ids` (block-table order) for a sequence that
        prefill worker `peer_id` will send under `tag` (unique among this peer's transfers in flight).
        Blocks until every layer's blocks landed in `kv_caches[layer][:, block_ids]`; returns the bytes
        received. Writes only those blocks. Raises TransferError (PeerLostError, TransferTimeoutError,
        LayoutMismatchError, TransferCancelledError) when its transfer does not start within `timeout_s`, or is
        not done within `timeout_s` of starting (so within about twice `timeout_s`); once it raised, nothing
        writes the blocks any more.
        """

    @abstractmethod
    def cancel(self, peer_id: str, tag: int) -> None:
        """Called from any thread when the caller of `recv(peer_id, tag, ...)` gives up (its request was
        cancelled): a recv whose transfer has not started raises TransferCancelledError at once, even one not yet
        posted (the sender's transfer for it is then refused); one already receiving ends as it would have (its
        blocks may be in use until it returns)."""
