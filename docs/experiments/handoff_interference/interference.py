"""Does a KV hand-off landing on a decode worker stall the streams it is already decoding?

A decode-only `AsyncEngine` (as a decode worker builds it: no prefix caching, `--threads` torch threads) decodes
`--streams` long sequences while new requests arrive every `--interval` s, in three phases, alternated each round:
  none      no new requests
  commands  each new request is reserved and committed (max_tokens 1: it ends at its commit), no KV bytes
  handoff   the same, with the prompt's KV (`--prompt-tokens`, drawn in turn) sent in between by a sender in a child
            process (`TorchDistSender`, as a prefill worker sends; at `--sender-nice`, 19: a host of its own) into
            the reserved blocks (`TorchDistReceiver.recv` in a transfer thread, as services/decode/handoff.py does)
  handoff-nice  the same, with this process's transfer threads (gloo's I/O loop, the pair's serving thread) at
            nice 10 for the phase: does yielding the cores to the decode steps spare their ITL, and what does the
            receive pay for it
Each stream's inter-token gaps are taken where its outputs arrive (the asyncio loop, as the servicer reads them);
a gap (and an engine step) that overlaps a receive (from the send's order to the recv's return) is counted
apart; in the phases without receives, those overlapping a window 0.1-0.2 s after each scheduled request. Per
phase, the CPU seconds of each thread of this process (by name, from /proc) and of the sender show where the time
goes.

    .venv/bin/python docs/experiments/handoff_interference/interference.py --rounds 3 --rows rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import statistics
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.threads import in_transfer_thread
from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender

HOST = "127.0.0.1"
PEER = "sender"
PHASES = ("none", "commands", "handoff", "handoff-nice")
TRANSFER_THREADS = ("gloo_tcp_loop", "kv-recv")  # gloo's I/O loop (it moves the bytes), the pair's serving thread


def _sender_main(conn: Connection, layers: int, shape: list[int], dtype: str, fingerprint: str, nice: int) -> None:
    """The child: a prefill worker's sender, with a cache of the decode engine's layout (random bytes)."""
    torch.set_num_threads(1)
    os.nice(nice)  # 19: as a prefill worker on a host of its own, its side of the copy takes no core the steps want
    caches = [torch.randn(shape).to(getattr(torch, dtype)) for _ in range(layers)]
    sender = TorchDistSender(HOST, "cpu", fingerprint, backend="gloo")
    conn.send({"ready": True})
    while (cmd := conn.recv()) is not None:
        sender.send(cmd["rendezvous"], cmd["tag"], caches, list(range(cmd["blocks"])), 60.0)
        conn.send({"sent": True})
    sender.close()


def _thread_cpu() -> Counter[str]:
    """CPU seconds of this process's threads, summed by name: Python's own, the OS's for the others (gloo's,
    torch's)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Counter[str] = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), name)
        out[name.rstrip("0123456789_-")] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _renice_transfer_threads(nice: int) -> None:
    """Sets the niceness of this process's transfer threads (lowering it back needs root, which this host is)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = names.get(int(tid)) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(TRANSFER_THREADS):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Run:
    def __init__(self, engine: AsyncEngine, receiver: TorchDistReceiver, conn: Connection, args: argparse.Namespace):
        self.engine, self.receiver, self.conn, self.args = engine, receiver, conn, args
        self.arrivals: dict[str, list[float]] = {}
        self.receives: list[tuple[float, float]] = []
        self.runs: list[int] = []  # per receive, the runs of consecutive ids its blocks form (1: copy-free)
        self.commands: list[tuple[float, float]] = []
        self.steps: list[tuple[float, float, float]] = []  # (end, wall seconds, engine thread's CPU clock at end)
        self.n = 0
        engine.on_step = lambda _prefill, _decode, seconds, _context: self.steps.append(
            (time.perf_counter(), seconds, time.thread_time())
        )

    async def stream(self, rid: str) -> None:
        times = self.arrivals.setdefault(rid, [])
        prompt = list(range(100, 116))
        await self.engine.reserve(EngineRequest(rid, prompt, SamplingParams(max_tokens=8000, ignore_eos=True)))
        async for _ in self.engine.commit_and_stream(rid, FirstToken(5, True, 0)):
            times.append(time.perf_counter())

    async def handoff(self, phase: str, tokens: int) -> None:
        self.n += 1
        rid = f"new-{self.n}"
        request = EngineRequest(rid, [7] * tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        blocks = await self.engine.reserve(request)
        if phase.startswith("handoff"):
            rendezvous = await in_transfer_thread(self.receiver.rendezvous, PEER)
            tag = secrets.randbits(63)
            caches = self.engine.kv_caches
            receive = asyncio.ensure_future(in_transfer_thread(self.receiver.recv, PEER, tag, caches, blocks, 60.0))
            await asyncio.sleep(0.001)  # posted before the sender starts, as the prefill worker's call takes longer
            sent_at = time.perf_counter()
            self.conn.send({"rendezvous": rendezvous, "tag": tag, "blocks": len(blocks)})
            await receive
            self.receives.append((sent_at, time.perf_counter()))
            self.runs.append(1 + sum(b != a + 1 for a, b in zip(blocks, blocks[1:], strict=False)))
            await asyncio.to_thread(self.conn.recv)
        async for _ in self.engine.commit_and_stream(rid, FirstToken(5, True, 0)):
            pass
        self.commands.append((start, time.perf_counter()))

    async def phase(self, phase: str, seconds: float) -> dict[str, Any]:
        for times in self.arrivals.values():
            times.clear()
        self.receives.clear()
        self.runs.clear()
        self.commands.clear()
        self.steps.clear()
        _renice_transfer_threads(10 if phase == "handoff-nice" else 0)
        cpu0, sender0, wall0 = _thread_cpu(), _process_cpu(self.args.sender_pid), time.perf_counter()
        i = 0
        while wall0 + i * self.args.interval < wall0 + seconds:  # one new request every interval, in turn
            await asyncio.sleep(max(0.0, wall0 + i * self.args.interval - time.perf_counter()))
            if phase != "none":
                await self.handoff(phase, self.args.prompt_tokens[i % len(self.args.prompt_tokens)])
            i += 1
        await asyncio.sleep(max(0.0, wall0 + seconds - time.perf_counter()))
        wall = time.perf_counter() - wall0
        # Without receives, windows of a typical receive's offset and length after each scheduled request: the
        # gaps and steps that overlap them show what picking by overlap alone does (longer ones overlap more).
        control = [(wall0 + k * self.args.interval + 0.1, wall0 + k * self.args.interval + 0.2) for k in range(i)]
        windows = self.receives if phase.startswith("handoff") else control
        cpu = _thread_cpu() - cpu0
        gaps, during = [], []
        for times in self.arrivals.values():
            for a, b in zip(times, times[1:], strict=False):
                gaps.append((b - a) * 1e3)
                if any(a < r1 and b > r0 for r0, r1 in windows):
                    during.append((b - a) * 1e3)
        steps: dict[str, list[list[float]]] = {"overlap": [], "apart": []}
        for (e0, _, c0), (e1, w1, c1) in zip(self.steps, self.steps[1:], strict=False):
            overlaps = any(e1 - w1 < r1 and e1 > r0 for r0, r1 in windows)
            # the step's wall ms, and the engine thread's CPU ms over the loop's period (step and commands)
            steps["overlap" if overlaps else "apart"].append([w1 * 1e3, (e1 - e0) * 1e3, (c1 - c0) * 1e3])
        return {
            "phase": phase,
            "steps": steps,
            "wall_s": wall,
            "handoffs": len(self.commands),
            "receive_ms": [(r1 - r0) * 1e3 for r0, r1 in self.receives],
            "receive_runs": list(self.runs),
            "handoff_ms": [(c1 - c0) * 1e3 for c0, c1 in self.commands],
            "gaps_ms": gaps,
            "gaps_overlapping_ms": during,
            "thread_cpu_s": {k: round(v, 2) for k, v in cpu.items() if v > 0},
            "sender_cpu_s": _process_cpu(self.args.sender_pid) - sender0,
        }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _measure(run: Run, rounds: int, seconds: float) -> list[dict[str, Any]]:
    background = [asyncio.ensure_future(run.stream(f"bg-{i}")) for i in range(run.args.streams)]
    await asyncio.sleep(3.0)
    await run.phase("handoff", 5.0)  # warm-up: the pair connects, buffers are allocated
    rows = []
    for r in range(rounds):
        for phase in PHASES if r % 2 == 0 else PHASES[::-1]:
            row = await run.phase(phase, seconds)
            row["round"] = r
            rows.append(row)
            g = row["gaps_ms"]
            print(
                f"round {r} {phase:12s} handoffs {row['handoffs']:3d} gaps {len(g):5d} "
                f"ITL p50 {_pct(g, 0.5):6.1f} p99 {_pct(g, 0.99):6.1f} max {max(g):6.1f} ms; "
                f"during receive p50 {_pct(row['gaps_overlapping_ms'], 0.5):6.1f}; "
                f"receive p50 {_pct(row['receive_ms'], 0.5):6.1f} ms",
                flush=True,
            )
            if ended := [t for t in background if t.done()]:
                raise RuntimeError(f"a stream ended: {ended[0].exception()!r}")
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> None:
    print("phase        | ITL p50 ms | p99 ms | max ms | gaps overlapping a receive (window) p50 / p99 | receive p50")
    base = None
    for phase in PHASES:
        mine = [r for r in rows if r["phase"] == phase]

        def med(f: Any, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(f(r) for r in mine)

        p50, p99, mx = (med(lambda r, q=q: _pct(r["gaps_ms"], q)) for q in (0.5, 0.99, 1.0))
        d50, d99 = (med(lambda r, q=q: _pct(r["gaps_overlapping_ms"], q)) for q in (0.5, 0.99))
        rec = med(lambda r: _pct(r["receive_ms"], 0.5))
        base = base or (p50, p99)
        print(
            f"{phase:12s} | {p50:10.1f} | {p99:6.1f} | {mx:6.1f} | {d50:6.1f} / {d99:6.1f} | {rec:6.1f} "
            f"(p99 x{p99 / base[1]:.2f})"
        )
        cpu: Counter[str] = Counter()
        for r in mine:
            cpu.update({k: v / r["wall_s"] for k, v in r["thread_cpu_s"].items()})
        top = ", ".join(f"{k} {v / len(mine):.2f}" for k, v in cpu.most_common(6))
        sender = statistics.mean(r["sender_cpu_s"] / r["wall_s"] for r in mine)
        print(f"         cores busy by thread: {top}; sender process {sender:.2f}")
        for kind in ("apart", "overlap"):
            steps = [s for r in mine for s in r["steps"][kind]]
            if steps:
                step, period, cpu = (statistics.median(s[i] for s in steps) for i in range(3))
                print(
                    f"         steps {kind:7s}: {len(steps):4d}, step p50 {step:.1f} ms, "
                    f"loop period p50 {period:.1f} ms, engine thread CPU p50 {cpu:.1f} ms"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (a worker: the CPUs it may use)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between new requests")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sender-nice", type=int, default=19, help="0: the sender competes for this host's cores")
    parser.add_argument("--rows", type=Path)
    args = parser.parse_args()
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY, max_num_batched_tokens=2048 + 64)
    config = EngineConfig(
        model=args.model, num_threads=args.threads, num_kv_blocks=2048, enable_prefix_caching=False, scheduler=scheduler
    )
    engine = AsyncEngine(LLMEngine(config))
    kv = engine.kv_caches
    receiver = TorchDistReceiver(HOST, "cpu", engine.fingerprint, backend="gloo")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    shape = [2, max(args.prompt_tokens) // engine.block_size + 1, *kv[0].shape[2:]]
    dtype = str(kv[0].dtype).removeprefix("torch.")
    proc = ctx.Process(target=_sender_main, args=(child, len(kv), shape, dtype, engine.fingerprint, args.sender_nice))
    proc.start()
    parent.recv()
    args.sender_pid = proc.pid
    try:
        rows = asyncio.run(_measure(Run(engine, receiver, parent, args), args.rounds, args.seconds))
    finally:
        parent.send(None)
        proc.join(timeout=10)
        receiver.close()
        engine.stop()
    summarize(rows)
    if args.rows:
        args.rows.write_text(json.dumps({"args": {**vars(args), "rows": str(args.rows)}, "rows": rows}))


if __name__ == "__main__":
    main()
