"""One pair's process groups and the waits on them; every backend failure leaves here as a TransferError.

Control always goes over gloo (CPU tensors): a posted gloo receive notices a dead peer at once and never times
out an NCCL kernel. gloo closes a pair when a wait times out, so such a timeout costs the pair.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.transfer.base import PeerLostError, TransferError, TransferTimeoutError
from pdserve.transfer.wire import STATUS_LEN

# The caller's tag never reaches the backend (NCCL ignores tags): it travels in the header.
_CTRL_TAG = 0
_DATA_TAG = 1  # + message index (2 * layer + half)
# How long a pair may sit idle between transfers before gloo closes it; a later rendezvous builds a new one.
_IDLE_TIMEOUT = timedelta(days=7)


def time_left(deadline: float) -> float:
    return deadline - time.monotonic()


def error_summary(e: BaseException) -> str:
    """The first line of a backend error: torch's messages carry whole C++ stack traces."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]


def as_transfer_error(e: BaseException, name: str) -> TransferError:
    return e if isinstance(e, TransferError) else PeerLostError(f"{name}: {error_summary(e)}")


def gloo_device(host: str) -> object:
    """gloo binds here and advertises it: this worker's configured address, never every interface."""
    return dist.ProcessGroupGloo.create_device(hostname=host)


class PairGroup:
    """Rank 0 is the prefill side, rank 1 the decode side."""

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
    ) -> PairGroup:
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
            raise PeerLostError(f"{name}: building the pair group failed: {error_summary(e)}") from e
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
            raise PeerLostError(f"{self.name}: peer lost: {error_summary(e)}") from e

    def wait(self, work: dist.Work, deadline: float | None, nccl: bool = False) -> None:
        """Waits for one op; deadline None waits as long as the pair may idle."""
        try:
            if nccl:
                self._poll(work, deadline)
            else:
                work.wait(_IDLE_TIMEOUT if deadline is None else timedelta(seconds=max(time_left(deadline), 0.001)))
        except TransferError:
            raise
        except RuntimeError as e:
            if (deadline is not None and time_left(deadline) < 0.05) or "Timed out" in str(e):
                raise TransferTimeoutError(f"{self.name}: timed out") from e
            raise PeerLostError(f"{self.name}: peer lost: {error_summary(e)}") from e

    def _poll(self, work: dist.Work, deadline: float | None) -> None:
        # NCCL work.wait() only orders streams; poll so a silent peer fails at our deadline, then abort the kernels.
        delay = 1e-4
        while not work.is_completed():
            if deadline is not None and time_left(deadline) <= 0:
                self.close()
                raise TransferTimeoutError(f"{self.name}: timed out (NCCL)")
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        work.wait()

    def ctrl_op(self, send: bool, t: torch.Tensor) -> dist.Work:
        return self._op(self.ctrl.send if send else self.ctrl.recv, t, _CTRL_TAG)

    def recv_ctrl(self, n: int, deadline: float | None) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.int64)
        self.wait(self.ctrl_op(False, t), deadline)
        return t

    def send_status(self, code: int, detail: int, deadline: float | None) -> None:
        self.wait(self.ctrl_op(True, torch.tensor([code, detail], dtype=torch.int64)), deadline)

    def recv_status(self, deadline: float) -> tuple[int, int]:
        code, detail = self.recv_ctrl(STATUS_LEN, deadline).tolist()
        return code, detail

    def data_op(self, send: bool, buf: torch.Tensor, message: int) -> dist.Work:
        return self._op(self.data.send if send else self.data.recv, buf, _DATA_TAG + message)

    def wait_data(self, work: dist.Work, deadline: float) -> None:
        self.wait(work, deadline, nccl=self.backend == "nccl")

    def close(self) -> None:
        if self.backend == "nccl":  # unblocks kernels stuck on a dead peer
            with contextlib.suppress(Exception):
                self.data.abort()
