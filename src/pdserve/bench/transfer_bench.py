"""KV transfer throughput between two processes, against raw gloo and an in-process copy, same run.

The parent process sends (prefill side), a spawned child receives (decode side). For each case:
  ours      TorchDistSender.send of the sequence's blocks into the child's preallocated blocks; timed on the
            sender until the receiver reports them in place. Block ids on each side are those a BlockManager
            hands a new sequence in a pool other sequences have churned through (what the workers send), one
            run (a fresh pool), or random (the worst case: every block alone, so both sides copy).
  raw gloo  one contiguous tensor of the same bytes over a plain gloo pair, plus a one-element ack back.
  copy      an in-process copy of the same bytes into a preallocated tensor.
Before each timed send the child has already posted its receive, so neither side waits for the other's start.
The two processes talk over a pipe in JSON; nothing is pickled.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config import ClusterConfig, EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.torch_dist import Backend, TorchDistReceiver, TorchDistSender

_RAW_TAG = 7


@dataclass(frozen=True)
class TransferCase:
    name: str
    dtype: str
    num_blocks: int  # blocks the sequence occupies
    num_layers: int = 30  # SmolLM2-135M
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = EngineConfig.block_size
    ids: str = "allocator"  # "allocator" (after churn), "run" (a, a+1, ...) or "random"
    pool_bytes: int = 1 << 30  # each side's cache, as a worker's default pool

    @property
    def layout(self) -> KVLayout:
        return KVLayout("bench", self.dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return self.layout.bytes_for(self.num_blocks)

    @property
    def cache_blocks(self) -> int:
        """`pool_bytes` of blocks (1 GiB of SmolLM2 bf16: 2,917), at least 4x the sequence."""
        return max(self.pool_bytes // self.layout.bytes_for(1), 4 * self.num_blocks)

    def caches(self, device: str, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shape = (2, self.cache_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        dtype = self.layout.torch_dtype
        return [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(self.num_layers)]

    def block_ids(self, seed: int, side: str) -> list[int]:
        """`side` "prefill" allocates prompts in 512-token chunks, "decode" reserves a whole prompt at once
        (each as their workers do)."""
        g = torch.Generator().manual_seed(seed)
        if self.ids == "run":
            start = int(torch.randint(0, self.cache_blocks - self.num_blocks, (1,), generator=g))
            return list(range(start, start + self.num_blocks))
        if self.ids == "random":
            return torch.randperm(self.cache_blocks, generator=g)[: self.num_blocks].tolist()
        if side == "prefill":  # a few prompts hold blocks at a time, in 512-token chunks; freed ones stay cached
            return churned_block_ids(self.cache_blocks, self.num_blocks, self.block_size, 0.1, 512, True, seed)
        # many decoding sequences hold blocks; each reservation is a whole prompt; nothing is cached
        return churned_block_ids(self.cache_blocks, self.num_blocks, self.block_size, 0.6, 1 << 30, False, seed)


def churned_block_ids(
    pool_blocks: int,
    num_blocks: int,
    block_size: int,
    in_use: float,
    chunk_tokens: int,
    prefix_caching: bool,
    seed: int,
) -> list[int]:
    """The table a BlockManager gives a new sequence of `num_blocks` in a worker that has been serving a while:
    2,000 sequences of 1-128 blocks came and went in random order, keeping about `in_use` of the pool held, each
    allocated `chunk_tokens` at a time as the scheduler does. With `prefix_caching` (prefill workers) freed
    blocks stay cached, so most free blocks are cached ones, evicted on demand; decode workers cache nothing."""
    rng = random.Random(seed)
    bm = BlockManager(pool_blocks, block_size, prefix_caching)
    live: list[Sequence] = []

    def admit(seq_id: int, blocks: int) -> Sequence | None:
        seq = Sequence(f"s{seq_id}", [seq_id] * (blocks * block_size), SamplingParams())
        while seq.num_computed_tokens < seq.num_tokens:
            chunk = min(chunk_tokens, seq.num_uncomputed_tokens)
            if not bm.allocate_slots(seq, chunk):
                bm.free(seq)
                return None
            seq.num_computed_tokens += chunk
            bm.cache_full_blocks(seq)
        return seq

    for i in range(2000):
        if live and (bm.num_used_blocks > in_use * pool_blocks or rng.random() < 0.3):
            bm.free(live.pop(rng.randrange(len(live))))
        elif (seq := admit(i, rng.randint(1, 128))) is not None:
            live.append(seq)
    while bm.num_free_blocks < num_blocks:
        bm.free(live.pop(rng.randrange(len(live))))
    seq = admit(-1, num_blocks)
    assert seq is not None
    return seq.block_table


def count_runs(ids: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:], strict=False))


def default_cases(tokens: int = 1000, mib: int = 64) -> list[TransferCase]:
    blocks = math.ceil(tokens / 16)
    per_block = TransferCase("", "bfloat16", 1).nbytes
    return [
        TransferCase(f"SmolLM2 {tokens} tok bf16", "bfloat16", blocks),
        TransferCase(f"SmolLM2 {tokens} tok fp32", "float32", blocks),
        TransferCase(f"{mib} MiB of blocks bf16", "bfloat16", (mib << 20) // per_block),
        TransferCase(f"SmolLM2 {tokens} tok bf16", "bfloat16", blocks, ids="run"),
        TransferCase(f"SmolLM2 {tokens} tok bf16", "bfloat16", blocks, ids="random"),
        TransferCase(f"{mib} MiB of blocks bf16", "bfloat16", (mib << 20) // per_block, ids="random"),
    ]


def _send_json(conn: Connection, obj: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _recv_json(conn: Connection) -> dict[str, Any]:
    return json.loads(conn.recv_bytes())


def _raw_group(store: dist.Store, rank: int, host: str) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=60)
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _recv_into(
    receiver: TorchDistReceiver, tag: int, caches: list[torch.Tensor], ids: list[int], result: dict[str, Any]
) -> None:
    result["nbytes"] = receiver.recv("bench-parent", tag, caches, ids, 60.0)


def _receiver_main(conn: Connection, host: str, device: str, backend: Backend, pipeline_mib: int) -> None:
    """The child: decode side of our transfer and of the raw gloo pair, driven by the parent over `conn`."""
    receiver = TorchDistReceiver(host, device, "bench", backend=backend, pipeline_bytes=pipeline_mib << 20)
    raw_store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    _send_json(conn, {"rendezvous": receiver.rendezvous("bench-parent"), "raw_port": raw_store.port})
    raw = _raw_group(raw_store, 1, host)
    caches: list[torch.Tensor] = []
    raw_buf = torch.empty(0, dtype=torch.uint8)
    while True:
        cmd = _recv_json(conn)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "case":
            case = TransferCase(**cmd["case"])
            caches = case.caches(device, seed=2)
            raw_buf = torch.empty(case.nbytes, dtype=torch.uint8)
            _send_json(conn, {"ok": True})
        elif op == "ours":
            result: dict[str, Any] = {}
            t = threading.Thread(target=_recv_into, args=(receiver, cmd["tag"], caches, cmd["ids"], result))
            t.start()
            time.sleep(0.005)  # registered well before the parent starts its clock
            _send_json(conn, {"ready": True})
            t.join()
            _send_json(conn, result)
        elif op == "raw":
            work = raw.recv([raw_buf], 0, _RAW_TAG)
            _send_json(conn, {"ready": True})
            work.wait()
            raw.send([torch.ones(1, dtype=torch.uint8)], 0, _RAW_TAG).wait()
            _send_json(conn, {"ok": True})
    receiver.close()
    # Out before the interpreter's shutdown, whose teardown (the pair's serving thread still blocked in a gloo receive,
    # which gloo cannot cancel) aborted the child after every run: "terminate called without an active exception"
    # under the figures, SIGABRT. Nothing is left to flush but stderr.
    sys.stderr.flush()
    os._exit(0)


def _median_gb_s(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


@dataclass(frozen=True)
class TransferRow:
    name: str
    blocks: int
    ids: str
    runs: str  # runs of consecutive ids, sender/receiver
    mib: float
    ours_gb_s: float
    raw_gloo_gb_s: float
    copy_gb_s: float

    @property
    def ratio(self) -> float:
        return self.ours_gb_s / self.raw_gloo_gb_s


def _measure_case(
    case: TransferCase,
    conn: Connection,
    sender: TorchDistSender,
    rendezvous: str,
    raw: Any,
    device: str,
    repeats: int,
    warmup: int,
    tag_base: int,
) -> TransferRow:
    _send_json(conn, {"op": "case", "case": asdict(case)})
    _recv_json(conn)
    caches = case.caches(device, seed=1)
    src_ids, dst_ids = case.block_ids(seed=3, side="prefill"), case.block_ids(seed=4, side="decode")
    src = torch.randint(0, 255, (case.nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    ack = torch.empty(1, dtype=torch.uint8)
    ours: list[float] = []
    raw_times: list[float] = []
    copies: list[float] = []
    # Interleaved, one of each per repeat, so a busy neighbour slows all three alike.
    for i in range(warmup + repeats):
        _send_json(conn, {"op": "ours", "tag": tag_base + i, "ids": dst_ids})
        _recv_json(conn)
        start = time.perf_counter()
        nbytes = sender.send(rendezvous, tag_base + i, caches, src_ids, 60.0)
        elapsed = time.perf_counter() - start
        got = _recv_json(conn)
        if nbytes != case.nbytes or got.get("nbytes") != case.nbytes:
            raise RuntimeError(f"{case.name}: sent {nbytes} bytes, received {got}, expected {case.nbytes}")

        _send_json(conn, {"op": "raw"})
        _recv_json(conn)
        start = time.perf_counter()
        raw.send([src], 1, _RAW_TAG).wait()
        raw.recv([ack], 1, _RAW_TAG).wait()
        raw_elapsed = time.perf_counter() - start
        _recv_json(conn)

        start = time.perf_counter()
        dst.copy_(src)
        copy_elapsed = time.perf_counter() - start
        if i >= warmup:
            ours.append(elapsed)
            raw_times.append(raw_elapsed)
            copies.append(copy_elapsed)

    return TransferRow(
        name=case.name,
        blocks=case.num_blocks,
        ids=case.ids,
        runs=f"{count_runs(src_ids)}/{count_runs(dst_ids)}",
        mib=case.nbytes / 2**20,
        ours_gb_s=_median_gb_s(case.nbytes, ours),
        raw_gloo_gb_s=_median_gb_s(case.nbytes, raw_times),
        copy_gb_s=_median_gb_s(case.nbytes, copies),
    )


def run_transfer_bench(
    cases: list[TransferCase] | None = None,
    host: str = ClusterConfig.host,
    device: str = "cpu",
    backend: Backend = "auto",
    repeats: int = 7,
    warmup: int = 2,
    pipeline_mib: int = 32,
    peer_device: str | None = None,
) -> dict[str, Any]:
    """Measures every case between this process and a spawned one, prints a rich table, returns the figures.
    `peer_device`: where the receiver's caches live (default `device`; NCCL needs another GPU)."""
    from rich.table import Table

    from pdserve.bench.report_console import report_console

    cases = cases if cases is not None else default_cases()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    receiver_args = (child_conn, host, peer_device or device, backend, pipeline_mib)
    child = ctx.Process(target=_receiver_main, args=receiver_args, daemon=True)
    child.start()
    rows: list[TransferRow] = []
    try:
        if not conn.poll(120):
            raise RuntimeError("the receiver process did not start within 120 s")
        hello = _recv_json(conn)
        raw_store = dist.TCPStore(host, hello["raw_port"], 2, False, timeout=timedelta(seconds=60))
        raw = _raw_group(raw_store, 0, host)
        sender = TorchDistSender(host, device, "bench", backend=backend, pipeline_bytes=pipeline_mib << 20)
        for i, case in enumerate(cases):
            row = _measure_case(case, conn, sender, hello["rendezvous"], raw, device, repeats, warmup, (i + 1) * 1000)
            rows.append(row)
        _send_json(conn, {"op": "quit"})
        sender.close()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()

    result: dict[str, Any] = {
        "device": device,
        "backend": backend,
        "repeats": repeats,
        "pipeline_mib": pipeline_mib,
        "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
    }
    console = report_console()
    console.print(f"device {device}, backend {backend}, median of {repeats} repeats, GB = 1e9 bytes")
    table = Table(title="pdserve KV transfer bench (two processes)")
    columns = ("case", "blocks", "block ids", "runs", "MiB", "ours GB/s", "raw gloo GB/s", "ours/raw", "copy GB/s")
    for col in columns:
        table.add_column(col, justify="left" if col == "case" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.name,
            str(r.blocks),
            r.ids,
            r.runs,
            f"{r.mib:.1f}",
            f"{r.ours_gb_s:.2f}",
            f"{r.raw_gloo_gb_s:.2f}",
            f"{r.ratio:.2f}×",
            f"{r.copy_gb_s:.2f}",
        )
    console.print(table)
    return result
