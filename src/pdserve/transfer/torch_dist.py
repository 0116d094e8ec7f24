"""KV transfer over one torch.distributed pair group per (prefill, decode) pair: gloo, or NCCL between CUDA caches.

The decode side (rank 1) hosts a TCPStore per prefill peer, bound to its own host; the prefill side (rank 0)
connects to it on its first send. Both write their device and backend preference into the store and pick the
same backend: NCCL when both caches are on CUDA (and NCCL exists on both), gloo otherwise.

One transfer at a time goes over a pair, in the order the sender starts them (a lock on the sender, one
serving thread on the receiver), so several concurrent transfers share a pair safely:
  1. sender -> receiver, control: header, int64[16]: magic, version, tag, block count, layout, message size, timeout
  2. sender -> receiver, data: layer by layer, two messages per layer (keys, then values), each the sequence's
     blocks as [blocks, block_size, kv_heads, head_dim] bytes; later messages are gathered while earlier ones are
     on the wire, up to `pipeline_bytes` in flight per side. A side whose block ids are one run (a, a+1, ...)
     sends from / receives into its cache directly, with no copy; otherwise it gathers / scatters through
     staging buffers (keys and values are apart in the cache, hence two messages: both can be direct).
  3. receiver -> sender, control: status int64[2]: the blocks are in place, or why not (layout mismatch, no
     recv waiting for that tag, block count); a rejected transfer's layers are received and discarded
There is no "go" round trip before the data: on a busy host each extra wake-up costs up to a scheduler tick.
gloo aborts the whole process when a message is larger than the receive posted for it, so every data receive
is posted with the size the header announced, and a transfer is accepted only when that size is ours.
The caller's tag never reaches the backend (NCCL ignores tags): it travels in the header, and the receiver
hands the transfer to the `recv` waiting for that tag. Control always goes over gloo (CPU tensors): the
receiver keeps a header receive posted between transfers, which is what notices a dead sender at once, and
a posted gloo receive never times out an NCCL kernel. gloo closes a pair when a wait times out, so a timeout
during steps 1-3 drops the pair; a `recv` that times out before its header arrived leaves the pair intact.
Nothing is pickled: the wire carries int64 control tensors and raw bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from pdserve.transfer.base import (
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    PeerLostError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.layout import KVLayout

log = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]

_MAGIC = 0x7064_4B56  # "pdKV"
_VERSION = 1
_HEADER_LEN = 16
_CTRL_TAG = 0
_DATA_TAG = 1  # + message index (2 * layer + half)
# How long a pair may sit idle between transfers before gloo closes it; a later rendezvous builds a new one.
_IDLE_TIMEOUT = timedelta(days=7)
_RECV_KEY = "pdserve/recv"
_SEND_KEY = "pdserve/send"
_CLAIM_KEY = "pdserve/claimed"

# Status codes of step 3.
_OK, _LAYOUT, _NOT_EXPECTED, _BLOCK_COUNT = range(4)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


@dataclass(frozen=True)
class _Header:
    tag: int
    num_blocks: int
    fingerprint_hash: int
    dtype_hash: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    message_bytes: int  # of each data message: lets the receiver drain a transfer it rejects
    timeout_ms: int

    @classmethod
    def for_transfer(cls, tag: int, num_blocks: int, layout: KVLayout, timeout_s: float) -> _Header:
        return cls(
            tag=tag,
            num_blocks=num_blocks,
            fingerprint_hash=_hash64(layout.model_fingerprint),
            dtype_hash=_hash64(layout.dtype),
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            message_bytes=layout.layer_block_bytes // 2 * num_blocks,
            timeout_ms=int(timeout_s * 1000),
        )

    def encode(self) -> torch.Tensor:
        t = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        values = [_MAGIC, _VERSION, self.tag, self.num_blocks, self.fingerprint_hash, self.dtype_hash]
        values += [self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.message_bytes]
        values += [self.timeout_ms]
        t[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return t

    @classmethod
    def decode(cls, t: torch.Tensor) -> _Header:
        v = t.tolist()
        if v[0] != _MAGIC or v[1] != _VERSION:
            raise PeerLostError(f"protocol error: header magic/version {v[0]:#x}/{v[1]}, want {_MAGIC:#x}/{_VERSION}")
        return cls(*v[2:12])

    def layout(self, mine: KVLayout) -> KVLayout:
        """The sender's layout as far as the hashes tell: strings that hash like ours are ours."""
        fingerprint = mine.model_fingerprint
        if _hash64(fingerprint) != self.fingerprint_hash:
            fingerprint = f"<another fingerprint, hash {self.fingerprint_hash & (2**64 - 1):016x}>"
        known = {_hash64(n): n for n in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2")}
        dtype = mine.dtype if _hash64(mine.dtype) == self.dtype_hash else known.get(self.dtype_hash, "<other dtype>")
        return KVLayout(fingerprint, dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim)


def _choose_backend(mine: str, theirs: str) -> str:
    """Both sides call this with the two "device preference nccl_ok" strings and get the same answer."""
    devices, prefs, nccl_ok = zip(*(s.split() for s in (mine, theirs)), strict=True)
    forced = set(prefs) - {"auto"}
    if len(forced) > 1:
        raise TransferError(f"backend conflict: one side wants gloo, the other nccl ({mine!r} vs {theirs!r})")
    nccl_possible = devices == ("cuda", "cuda") and nccl_ok == ("1", "1")
    if forced == {"nccl"} and not nccl_possible:
        raise TransferError(f"backend nccl needs CUDA caches and NCCL on both sides ({mine!r} vs {theirs!r})")
    if forced == {"gloo"}:
        return "gloo"
    return "nccl" if nccl_possible else "gloo"


def _block_index(tag: int, block_ids: Sequence[int], kv: torch.Tensor, distinct: bool) -> _Blocks:
    if not 0 <= tag < 2**63:
        raise ValueError(f"tag must lie in [0, 2**63), got {tag}")
    id_list = [int(i) for i in block_ids]
    ids = torch.as_tensor(id_list, dtype=torch.int64)
    num_blocks = kv.shape[1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = [i for i in ids.tolist() if not 0 <= i < num_blocks][:8]
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {bad}")
    if distinct and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"block ids must be distinct ({ids.numel()} ids, {torch.unique(ids).numel()} distinct)")
    is_run = bool(id_list) and id_list == list(range(id_list[0], id_list[0] + len(id_list)))
    return _Blocks(ids.to(kv.device), id_list[0] if is_run else None)


class _Blocks:
    """One side's block ids and how its data messages (layer, half) meet its cache.

    Scattered ids go through a contiguous byte buffer: on CPU with numpy (a single-threaded memcpy per block, GIL
    released; torch's index_copy_ is slow for bfloat16 and its OpenMP threads stall while gloo's I/O thread holds a
    core), on CUDA with index_select / index_copy_.
    """

    def __init__(self, ids: torch.Tensor, run_start: int | None) -> None:
        self.ids = ids
        self.n = ids.numel()
        self.run_start = run_start  # the ids are run_start, run_start + 1, ...
        if ids.device.type == "cpu":
            self.idx = ids.numpy()

    def direct(self, kv: torch.Tensor, half: int) -> torch.Tensor | None:
        """The cache bytes of (layer, half) as one flat uint8 tensor, when the ids are a run."""
        if self.run_start is None:
            return None
        return kv[half, self.run_start : self.run_start + self.n].view(-1).view(torch.uint8)

    def gather(self, kv: torch.Tensor, half: int, out: torch.Tensor) -> None:
        """out (uint8) <- kv[half, ids]"""
        if kv.device.type == "cpu":
            rows = kv[half].view(torch.uint8).numpy().reshape(kv.shape[1], -1)
            np.take(rows, self.idx, axis=0, out=out.numpy().reshape(self.n, -1), mode="clip")
        else:
            torch.index_select(kv[half], 0, self.ids, out=out.view(kv.dtype).view(self.n, *kv.shape[2:]))

    def scatter(self, src: torch.Tensor, kv: torch.Tensor, half: int) -> None:
        """kv[half, ids] <- src (uint8)"""
        if kv.device.type == "cpu":
            kv[half].view(torch.uint8).numpy().reshape(kv.shape[1], -1)[self.idx] = src.numpy().reshape(self.n, -1)
        else:
            kv[half].index_copy_(0, self.ids, src.view(kv.dtype).view(self.n, *kv.shape[2:]))


def _depth(pipeline_bytes: int, message_bytes: int, num_messages: int) -> int:
    """Messages in flight: as many as `pipeline_bytes` holds, at least two (one on the wire, one being copied)."""
    return max(2, min(num_messages, pipeline_bytes // max(message_bytes, 1)))


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]


class _Staging:
    """A pair's reusable message buffers, one slot per message in flight, allocated on first use.

    `work` lives on the cache device (gather / scatter there); `wire` is what the backend moves: the same tensor,
    or a pinned host copy when gloo carries CUDA caches (then the cache itself can never go on the wire).
    """

    def __init__(self, device: torch.device, wire_on_host: bool) -> None:
        self.device = device
        self.host = wire_on_host and device.type != "cpu"
        self._work: list[torch.Tensor] = []
        self._wire: list[torch.Tensor] = []

    def slot(self, i: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self._work) <= i:
            self._work.append(torch.empty(0, dtype=torch.uint8, device=self.device))
            self._wire.append(self._work[-1])
        if self._work[i].numel() < nbytes:
            self._work[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._wire[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if self.host else self._work[i]
        work = self._work[i][:nbytes]
        return work, (self._wire[i][:nbytes] if self.host else work)


class _PairGroup:
    """One pair's process groups (control over gloo, data over gloo or NCCL); failures become TransferErrors."""

    # ctrl / data are c10d backends (ProcessGroupGloo, ProcessGroupNCCL): no common typed base in torch's stubs.
    def __init__(self, ctrl: Any, data: Any, backend: str, peer: int, name: str) -> None:
        self.ctrl, self.data, self.backend, self.peer, self.name = ctrl, data, backend, peer, name

    @classmethod
    def build(
        cls,
        store: dist.Store,
        rank: int,
        gloo_device: object,
        backend: str,
        device: torch.device,
        timeout_s: float,
        name: str,
    ) -> _PairGroup:
        timeout = timedelta(seconds=max(timeout_s, 0.001))
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [gloo_device]
        opts._timeout = timeout
        opts._threads = 1  # the worker threads serve collectives only; send/recv run on gloo's I/O loop
        try:
            ctrl: Any = dist.ProcessGroupGloo(dist.PrefixStore("ctrl/", store), rank, 2, opts)
            data: Any = ctrl
            if backend == "nccl":
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = max(timeout, timedelta(minutes=10))
                data = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, nccl_opts)
        except RuntimeError as e:
            raise PeerLostError(f"{name}: building the pair group failed: {_describe(e)}") from e
        group = cls(ctrl, data, backend, 1 - rank, name)
        if backend == "nccl":  # NCCL builds its communicator on the first op: pay for it now, not in a transfer
            probe = torch.zeros(1, device=device)
            deadline = time.monotonic() + timeout_s
            group.wait(group._op(data.send if rank == 0 else data.recv, probe, _DATA_TAG), deadline, nccl=True)
        return group

    def _op(self, fn: object, t: torch.Tensor, tag: int) -> dist.Work:
        try:
            return fn([t], self.peer, tag)  # type: ignore[operator]
        except RuntimeError as e:
            raise PeerLostError(f"{self.name}: peer lost: {_describe(e)}") from e

    def wait(self, work: dist.Work, deadline: float | None, nccl: bool = False) -> None:
        """Waits for one op; deadline None waits as long as the pair may idle."""
        try:
            if nccl:
                self._poll(work, deadline)
            else:
                work.wait(_IDLE_TIMEOUT if deadline is None else timedelta(seconds=max(_remaining(deadline), 0.001)))
        except TransferError:
            raise
        except RuntimeError as e:
            if (deadline is not None and _remaining(deadline) < 0.05) or "Timed out" in str(e):
                raise TransferTimeoutError(f"{self.name}: timed out") from e
            raise PeerLostError(f"{self.name}: peer lost: {_describe(e)}") from e

    def _poll(self, work: dist.Work, deadline: float | None) -> None:
        # NCCL work.wait() only orders streams; poll so a silent peer fails at our deadline, then abort the kernels.
        delay = 1e-4
        while not work.is_completed():
            if deadline is not None and _remaining(deadline) <= 0:
                self.close()
                raise TransferTimeoutError(f"{self.name}: timed out (NCCL)")
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        work.wait()

    def ctrl_op(self, send: bool, t: torch.Tensor) -> dist.Work:
        return self._op(self.ctrl.send if send else self.ctrl.recv, t, _CTRL_TAG)

    def send_ctrl(self, values: torch.Tensor, deadline: float | None) -> None:
        self.wait(self.ctrl_op(True, values), deadline)

    def recv_ctrl(self, n: int, deadline: float | None) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.int64)
        self.wait(self.ctrl_op(False, t), deadline)
        return t

    def send_status(self, code: int, detail: int, deadline: float | None) -> None:
        self.send_ctrl(torch.tensor([code, detail], dtype=torch.int64), deadline)

    def data_op(self, send: bool, buf: torch.Tensor, message: int) -> dist.Work:
        return self._op(self.data.send if send else self.data.recv, buf, _DATA_TAG + message)

    def wait_data(self, work: dist.Work, deadline: float) -> None:
        self.wait(work, deadline, nccl=self.backend == "nccl")

    def close(self) -> None:
        if self.backend == "nccl":  # unblocks kernels stuck on a dead peer
            with contextlib.suppress(Exception):
                self.data.abort()


def _gloo_device(host: str) -> object:
    return dist.ProcessGroupGloo.create_device(hostname=host)


def _device_info(device: torch.device, backend: Backend) -> str:
    nccl_ok = int(device.type == "cuda" and dist.is_nccl_available())
    return f"{device.type} {backend} {nccl_ok}"


# ---------------------------------------------------------------------------------------------- sender


class _SendPair:
    def __init__(
        self, rendezvous: str, store: dist.Store, group: _PairGroup, identity: str, device: torch.device
    ) -> None:
        self.rendezvous, self.store, self.group, self.identity = rendezvous, store, group, identity
        self.lock = threading.Lock()  # one transfer at a time on the wire
        self.staging = _Staging(device, wire_on_host=group.backend == "gloo")
        self.broken = False


class TorchDistSender(KVSender):
    """Prefill side (rank 0 of every pair). `host` is this worker's address, the one gloo binds and advertises;
    `device` is where the caches live; `model_fingerprint` goes into the layout the decode side checks."""

    def __init__(
        self,
        host: str,
        device: torch.device | str = "cpu",
        model_fingerprint: str = "",
        backend: Backend = "auto",
        connect_timeout_s: float = 30.0,
        pipeline_bytes: int = 32 << 20,
    ) -> None:
        self.device = torch.device(device)
        self.fingerprint = model_fingerprint
        self.backend = backend
        self.connect_timeout_s = connect_timeout_s
        self.pipeline_bytes = pipeline_bytes
        self._gloo_device = _gloo_device(host)
        self._lock = threading.Lock()
        self._pairs: dict[str, _SendPair] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._closed = False

    def send(
        self,
        rendezvous: str,
        tag: int,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        timeout_s: float,
    ) -> int:
        layout = KVLayout.from_caches(kv_caches, self.fingerprint)
        if kv_caches[0].device.type != self.device.type:
            raise ValueError(f"caches are on {kv_caches[0].device}, this sender was built for {self.device}")
        blocks = _block_index(tag, block_ids, kv_caches[0], distinct=False)
        if blocks.n == 0:
            return 0  # the receiver short-circuits an empty transfer the same way
        deadline = time.monotonic() + timeout_s
        pair = self._pair(rendezvous, deadline)
        if not pair.lock.acquire(timeout=max(_remaining(deadline), 0)):
            raise TransferTimeoutError(f"tag {tag}: timed out waiting for earlier transfers to {rendezvous}")
        try:
            if pair.broken:
                raise PeerLostError(f"decode side {rendezvous}: pair dropped by a concurrent failure")
            code, detail = self._transfer(pair, tag, kv_caches, blocks, layout, deadline, timeout_s)
        except BaseException as e:
            self._drop(pair)
            if isinstance(e, RuntimeError) and not isinstance(e, TransferError):
                raise PeerLostError(f"decode side {rendezvous}: {_describe(e)}") from e
            raise
        finally:
            pair.lock.release()
        if code == _OK:
            return layout.bytes_for(blocks.n)
        where = f"decode side {rendezvous} rejected tag {tag}"
        if code == _LAYOUT:
            names = [f.name for i, f in enumerate(fields(KVLayout)) if detail >> i & 1]
            raise LayoutMismatchError(f"{where}: KV layout mismatch in {', '.join(names)} (ours: {layout})")
        if code == _NOT_EXPECTED:
            raise TransferError(f"{where}: no recv is waiting for that tag (timed out, cancelled or never posted)")
        if code == _BLOCK_COUNT:
            raise TransferError(f"{where}: it expects {detail} blocks, we sent {blocks.n}")
        raise TransferError(f"{where}: receive failed on the decode side (status {code})")

    def _transfer(
        self,
        pair: _SendPair,
        tag: int,
        kv_caches: Sequence[torch.Tensor],
        blocks: _Blocks,
        layout: KVLayout,
        deadline: float,
        timeout_s: float,
    ) -> tuple[int, int]:
        g = pair.group
        header = _Header.for_transfer(tag, blocks.n, layout, timeout_s)
        header_work = g.ctrl_op(True, header.encode())
        num_messages = 2 * layout.num_layers
        depth = _depth(self.pipeline_bytes, header.message_bytes, num_messages)
        in_flight: deque[dist.Work] = deque()
        for m in range(num_messages):
            if len(in_flight) == depth:
                g.wait_data(in_flight.popleft(), deadline)
            kv, half = kv_caches[m // 2], m % 2
            wire = None if pair.staging.host else blocks.direct(kv, half)
            if wire is None:
                work, wire = pair.staging.slot(m % depth, header.message_bytes)
                blocks.gather(kv, half, work)
                if wire is not work:
                    wire.copy_(work)
            in_flight.append(g.data_op(True, wire, m))
        g.wait(header_work, deadline)
        while in_flight:
            g.wait_data(in_flight.popleft(), deadline)
        code, detail = g.recv_ctrl(2, deadline).tolist()
        return code, detail

    def _pair(self, rendezvous: str, deadline: float) -> _SendPair:
        with self._lock:
            if self._closed:
                raise TransferError("sender is closed")
            pair = self._pairs.get(rendezvous)
            if pair is not None:
                return pair
            connecting = self._connecting.setdefault(rendezvous, threading.Lock())
        if not connecting.acquire(timeout=max(_remaining(deadline), 0)):
            raise TransferTimeoutError(f"decode side {rendezvous}: timed out waiting for the pair to connect")
        try:
            with self._lock:
                if rendezvous in self._pairs:
                    return self._pairs[rendezvous]
            pair = self._connect(rendezvous, min(deadline, time.monotonic() + self.connect_timeout_s))
            with self._lock:
                stale = [p for p in self._pairs.values() if p.identity == pair.identity]
                for p in stale:  # the decode side re-created our pair: the old one is dead
                    del self._pairs[p.rendezvous]
                    p.broken = True
                    p.group.close()
                self._pairs[rendezvous] = pair
                self._connecting.pop(rendezvous, None)  # waiters find the pair; on failure they retry
            return pair
        finally:
            connecting.release()

    def _connect(self, rendezvous: str, deadline: float) -> _SendPair:
        host, port = _split_address(rendezvous)
        name = f"decode side {rendezvous}"
        try:
            store = dist.TCPStore(
                host, port, 2, False, timeout=timedelta(seconds=max(_remaining(deadline), 0.001)), use_libuv=True
            )
            identity, their_info = store.get(_RECV_KEY).decode().split(" ", 1)
            claimed = store.add(_CLAIM_KEY, 1)
            mine = _device_info(self.device, self.backend)
            if claimed == 1:
                store.set(_SEND_KEY, mine)
        except RuntimeError as e:
            if _remaining(deadline) < 0.05:
                raise TransferTimeoutError(f"{name}: timed out connecting: {_describe(e)}") from e
            raise PeerLostError(f"{name}: cannot connect: {_describe(e)}") from e
        if claimed != 1:
            raise TransferError(f"{name}: another sender already holds this rendezvous (one sender per process)")
        backend = _choose_backend(mine, their_info)
        group = _PairGroup.build(store, 0, self._gloo_device, backend, self.device, _remaining(deadline), name)
        log.debug("kv sender: pair with %s over %s", rendezvous, backend)
        return _SendPair(rendezvous, store, group, identity, self.device)

    def _drop(self, pair: _SendPair) -> None:
        with self._lock:
            pair.broken = True
            if self._pairs.get(pair.rendezvous) is pair:
                del self._pairs[pair.rendezvous]
        pair.group.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.broken = True
            pair.group.close()


# -------------------------------------------------------------------------------------------- receiver

_WAITING, _RECEIVING, _FINISHED = range(3)


class _Pending:
    """One recv waiting for its tag; the serving thread fills it in."""

    def __init__(
        self, tag: int, kv_caches: Sequence[torch.Tensor], blocks: _Blocks, layout: KVLayout, deadline: float
    ) -> None:
        self.tag, self.kv_caches, self.blocks, self.layout, self.deadline = tag, kv_caches, blocks, layout, deadline
        self.state = _WAITING
        self.done = threading.Event()
        self.error: TransferError | None = None
        self.nbytes = 0


class _RecvPair:
    """The decode side of one prefill peer: its store, its group once built, the recvs waiting on it."""

    def __init__(self, peer_id: str, host: str, identity: str, info: str, connect_timeout_s: float) -> None:
        self.peer_id = peer_id
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))  # our host only: TCPStore itself would listen on every interface
            sock.listen(16)
            port = sock.getsockname()[1]
        except OSError:
            sock.close()
            raise
        fd = sock.detach()  # the store owns the socket from here on
        try:
            self.store = dist.TCPStore(
                host,
                port,
                2,
                True,
                timeout=timedelta(seconds=connect_timeout_s),
                wait_for_workers=False,
                master_listen_fd=fd,
                use_libuv=True,
            )
        except BaseException:
            os.close(fd)
            raise
        self.store.set(_RECV_KEY, f"{identity}/{peer_id} {info}")
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        self.cond = threading.Condition()
        self.pending: dict[int, _Pending] = {}
        self.abandoned: OrderedDict[int, None] = OrderedDict()
        self.error: TransferError | None = None
        self.closed = False

    def register(self, p: _Pending) -> None:
        with self.cond:
            if self.error is not None:
                raise type(self.error)(str(self.error))
            if p.tag in self.pending:
                raise ValueError(f"tag {p.tag} already has a recv waiting on peer {self.peer_id!r}")
            self.abandoned.pop(p.tag, None)
            self.pending[p.tag] = p
            self.cond.notify_all()

    def claim(self, tag: int, wait_s: float) -> _Pending | None:
        """Serving thread: the recv waiting for `tag`, or None when it gave up or never comes."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                p = self.pending.get(tag)
                if p is not None and p.state == _WAITING:
                    p.state = _RECEIVING
                    return p
                if tag in self.abandoned or self.error is not None or self.closed or _remaining(deadline) <= 0:
                    return None
                self.cond.wait(_remaining(deadline))

    def abandon(self, p: _Pending) -> bool:
        """recv's caller gave up; True when the serving thread had not started on it (nothing will write)."""
        with self.cond:
            if p.state != _WAITING:
                return False
            self._remove(p)
            self.abandoned[p.tag] = None
            while len(self.abandoned) > 4096:
                self.abandoned.popitem(last=False)
            return True

    def finish(self, p: _Pending, nbytes: int = 0, error: TransferError | None = None) -> None:
        with self.cond:
            self._remove(p)
            p.nbytes, p.error, p.state = nbytes, error, _FINISHED
        p.done.set()

    def _remove(self, p: _Pending) -> None:
        if self.pending.get(p.tag) is p:
            del self.pending[p.tag]

    def fail(self, error: TransferError) -> None:
        """The pair is dead: every waiting recv raises `error`; a receiving one is finished by the serving thread."""
        with self.cond:
            self.error = self.error or error
            waiting = [p for p in self.pending.values() if p.state == _WAITING]
            self.cond.notify_all()
        for p in waiting:
            self.finish(p, error=error)


class TorchDistReceiver(KVReceiver):
    """Decode side (rank 1 of every pair). `host` is this worker's configured address: each pair's store and gloo
    bind there (never every interface), on a port the OS picks. `device` is where the caches live."""

    def __init__(
        self,
        host: str,
        device: torch.device | str = "cpu",
        model_fingerprint: str = "",
        backend: Backend = "auto",
        connect_timeout_s: float = 30.0,
        pipeline_bytes: int = 32 << 20,
    ) -> None:
        self.host = host
        self.device = torch.device(device)
        self.fingerprint = model_fingerprint
        self.backend = backend
        self.connect_timeout_s = connect_timeout_s
        self.pipeline_bytes = pipeline_bytes
        self._identity = uuid.uuid4().hex
        self._gloo_device = _gloo_device(host)
        self._lock = threading.Lock()
        self._pairs: dict[str, _RecvPair] = {}
        self._lost: dict[str, str] = {}  # peer -> why its last pair died, until the next rendezvous
        self._closed = False

    def rendezvous(self, peer_id: str) -> str:
        with self._lock:
            if self._closed:
                raise TransferError("receiver is closed")
            pair = self._pairs.get(peer_id)
            if pair is None or pair.error is not None:
                info = _device_info(self.device, self.backend)
                pair = _RecvPair(peer_id, self.host, self._identity, info, self.connect_timeout_s)
                self._pairs[peer_id] = pair
                self._lost.pop(peer_id, None)
                threading.Thread(target=self._serve, args=(pair,), name=f"kv-recv-{peer_id}", daemon=True).start()
            return pair.address

    def recv(
        self,
        peer_id: str,
        tag: int,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        timeout_s: float,
    ) -> int:
        layout = KVLayout.from_caches(kv_caches, self.fingerprint)
        if kv_caches[0].device.type != self.device.type:
            raise ValueError(f"caches are on {kv_caches[0].device}, this receiver was built for {self.device}")
        blocks = _block_index(tag, block_ids, kv_caches[0], distinct=True)
        if blocks.n == 0:
            return 0
        deadline = time.monotonic() + timeout_s
        with self._lock:
            pair = self._pairs.get(peer_id)
            if pair is None:
                why = self._lost.get(peer_id)
                if why is not None:
                    raise PeerLostError(why)
                raise TransferError(f"no pair with prefill peer {peer_id!r}: call rendezvous() first")
        p = _Pending(tag, kv_caches, blocks, layout, deadline)
        pair.register(p)
        if not p.done.wait(max(_remaining(deadline), 0)):
            if pair.abandon(p):
                raise TransferTimeoutError(f"prefill peer {peer_id!r}: no KV data for tag {tag} within {timeout_s}s")
            # The serving thread holds it; its waits end at the same deadline.
            if not p.done.wait(self.connect_timeout_s):
                self._drop(pair, PeerLostError(f"prefill peer {peer_id!r}: transfer of tag {tag} is stuck"))
                raise TransferTimeoutError(f"prefill peer {peer_id!r}: tag {tag} stuck past its deadline")
        if p.error is not None:
            raise type(p.error)(str(p.error))  # a fresh exception per caller: one error may fail several recvs
        return p.nbytes

    def _serve(self, pair: _RecvPair) -> None:
        """The pair's serving thread: builds the group, then runs transfers one by one until the pair dies."""
        name = f"prefill peer {pair.peer_id!r}"
        try:
            group = self._accept(pair, name)
        except Exception as e:
            err = e if isinstance(e, TransferError) else PeerLostError(f"{name}: {_describe(e)}")
            self._drop(pair, err)
            return
        staging = _Staging(self.device, wire_on_host=group.backend == "gloo")
        while not pair.closed:
            p: _Pending | None = None
            try:
                header = _Header.decode(group.recv_ctrl(_HEADER_LEN, None))
                p = pair.claim(header.tag, header.timeout_ms / 2000)
                code, detail, error = self._check(p, header, name)
                deadline = p.deadline if p is not None else time.monotonic() + header.timeout_ms / 1000
                self._receive(group, staging, header, p if code == _OK else None, deadline)
                group.send_status(code, detail, deadline)
                if p is not None:
                    pair.finish(p, nbytes=p.layout.bytes_for(p.blocks.n) if error is None else 0, error=error)
            except Exception as e:
                err = e if isinstance(e, TransferError) else PeerLostError(f"{name}: {_describe(e)}")
                if p is not None:
                    pair.finish(p, error=err)
                self._drop(pair, err)
                group.close()
                return

    def _accept(self, pair: _RecvPair, name: str) -> _PairGroup:
        while not pair.store.check([_SEND_KEY]):  # the sender has not connected yet: wait as long as it takes
            if pair.closed:
                raise TransferError(f"{name}: receiver closed")
            time.sleep(0.02)
        theirs = pair.store.get(_SEND_KEY).decode()
        backend = _choose_backend(_device_info(self.device, self.backend), theirs)
        group = _PairGroup.build(pair.store, 1, self._gloo_device, backend, self.device, self.connect_timeout_s, name)
        log.debug("kv receiver: pair with %s over %s", pair.peer_id, backend)
        return group

    def _check(self, p: _Pending | None, header: _Header, name: str) -> tuple[int, int, TransferError | None]:
        if p is None:
            return _NOT_EXPECTED, 0, None
        theirs = header.layout(p.layout)
        diffs = p.layout.mismatches(theirs)
        if diffs:
            mask = sum(1 << i for i, f in enumerate(fields(KVLayout)) if f.name in diffs)
            try:
                p.layout.check_compatible(theirs)
            except LayoutMismatchError as e:
                return _LAYOUT, mask, LayoutMismatchError(f"{name}, tag {p.tag}: {e}")
        if header.message_bytes != p.layout.layer_block_bytes // 2 * p.blocks.n and header.num_blocks == p.blocks.n:
            # Same layout by the hashes, other sizes: never post a receive of the wrong size (gloo aborts on that).
            return _LAYOUT, 0, LayoutMismatchError(f"{name}, tag {p.tag}: message size {header.message_bytes} differs")
        if header.num_blocks != p.blocks.n:
            msg = f"{name}, tag {p.tag}: sender has {header.num_blocks} blocks, we reserved {p.blocks.n}"
            return _BLOCK_COUNT, p.blocks.n, TransferError(msg)
        return _OK, 0, None

    def _receive(
        self, group: _PairGroup, staging: _Staging, header: _Header, p: _Pending | None, deadline: float
    ) -> None:
        """Receives the header's messages into p's blocks, or into the staging buffers only when p is None."""
        num_messages, nbytes = 2 * header.num_layers, header.message_bytes
        depth = _depth(self.pipeline_bytes, nbytes, num_messages)

        def post(m: int) -> tuple[dist.Work, torch.Tensor, torch.Tensor, bool]:
            direct = p.blocks.direct(p.kv_caches[m // 2], m % 2) if p is not None and not staging.host else None
            if direct is not None:
                return group.data_op(False, direct, m), direct, direct, True
            work, wire = staging.slot(m % depth, nbytes)
            return group.data_op(False, wire, m), work, wire, False

        posted = deque(post(m) for m in range(min(depth, num_messages)))
        for m in range(num_messages):
            op, work, wire, direct = posted.popleft()
            group.wait_data(op, deadline)
            if p is not None and not direct:
                if wire is not work:
                    work.copy_(wire)
                p.blocks.scatter(work, p.kv_caches[m // 2], m % 2)
            if m + depth < num_messages:
                posted.append(post(m + depth))
        if p is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _drop(self, pair: _RecvPair, error: TransferError) -> None:
        with self._lock:
            if self._pairs.get(pair.peer_id) is pair:
                del self._pairs[pair.peer_id]
                self._lost[pair.peer_id] = str(error)
        pair.fail(error)

    def close(self) -> None:
        """Fails waiting recvs and forgets every pair. A serving thread blocked on an idle pair ends when its peer
        closes or exits (gloo cannot cancel a posted receive); it is a daemon, so it never holds up exit."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.closed = True
            pair.fail(TransferError(f"prefill peer {pair.peer_id!r}: receiver closed"))
