"""Does a decode worker's KV receive hold the GIL while its bytes are in flight?

A child process sends 256 blocks of smollm2-135m's layout (fp32, about 94 MB) into this process's
`TorchDistReceiver`, 0.3 s after the recv is posted, six times; a probe thread sleeps 1 ms in a loop meanwhile.
A receive that held the GIL would stall the probe for its whole length.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection

import torch

from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender

SHAPE = [2, 300, 16, 3, 64]
LAYERS = 30
DELAY_S = 0.3


def _child(conn: Connection) -> None:
    torch.set_num_threads(1)
    caches = [torch.randn(SHAPE) for _ in range(LAYERS)]
    sender = TorchDistSender("127.0.0.1", "cpu", "probe", backend="gloo")
    while (cmd := conn.recv()) is not None:
        time.sleep(DELAY_S)
        sender.send(cmd["rendezvous"], cmd["tag"], caches, list(range(256)), 60.0)
        conn.send(True)
    sender.close()


def main() -> None:
    caches = [torch.zeros(SHAPE) for _ in range(LAYERS)]
    receiver = TorchDistReceiver("127.0.0.1", "cpu", "probe", backend="gloo")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    lags: list[tuple[float, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            lags.append((t, time.perf_counter() - t - 0.001))

    threading.Thread(target=probe, daemon=True).start()
    for tag in range(1, 7):
        parent.send({"rendezvous": receiver.rendezvous("peer"), "tag": tag})
        t0 = time.perf_counter()
        receiver.recv("peer", tag, caches, list(range(256)), 60.0)
        t1 = time.perf_counter()
        parent.recv()
        during = [lag for t, lag in lags if t0 + DELAY_S < t < t1]
        before = [lag for t, lag in lags if t0 < t < t0 + DELAY_S - 0.02]
        print(
            f"receive {(t1 - t0 - DELAY_S) * 1e3:.0f} ms; probe's longest extra wait during it "
            f"{max(during, default=0) * 1e3:.1f} ms ({len(during)} wakes), before it {max(before) * 1e3:.1f} ms"
        )
    stop.set()
    parent.send(None)
    proc.join()
    receiver.close()


if __name__ == "__main__":
    main()
