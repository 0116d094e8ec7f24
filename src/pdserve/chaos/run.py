"""One chaos run against a router: the fault-free reference, then steady load while workers fail one at a time,
then the load's end, the cluster left idle, and the report."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

from pdserve.chaos.faults import Fault, Fleet
from pdserve.chaos.load import Load, prompts
from pdserve.chaos.report import summarize
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2_grpc, generate_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChaosConfig:
    kills: int = 20  # SIGKILLs, one worker at a time
    interval_s: float = 3.0  # from the cluster's recovery to the next fault
    stops: int = 1  # SIGSTOPs (the first of a decode worker, then alternating roles), spread among the kills
    stop_s: float = 25.0  # how long a stopped worker stays stopped: past the router's stall and first-token bounds
    rate: float = 4.0  # requests per second, Poisson
    prompts: int = 16  # distinct prompts the requests draw from
    input_len: int = 64
    output_len: int = 120
    seed: int = 0
    recover_timeout_s: float = 120.0  # a fault the cluster has not recovered from by then counts as not recovered
    settle_timeout_s: float = 120.0  # after the load stops, requests still open by then are lost
    idle_timeout_s: float = 30.0  # after the last request, how long KV blocks may take to be freed

    def schedule(self) -> list[tuple[str, str]]:
        """(kind, role) per fault in order: the stops spread evenly among the kills."""
        faults = [("kill", "")] * self.kills
        for i in reversed(range(self.stops)):
            faults.insert((i + 1) * self.kills // (self.stops + 1), ("stop", ("decode", "prefill")[i % 2]))
        return faults


async def run_chaos(config: ChaosConfig, address: str, vocab_size: int) -> dict[str, Any]:
    rng = random.Random(config.seed)
    async with channel(address) as ch:
        fleet = Fleet(admin_pb2_grpc.AdminStub(ch), config.recover_timeout_s, rng)
        prompt_set = prompts(config.prompts, config.input_len, vocab_size, config.seed)
        load = Load(generate_pb2_grpc.GenerationStub(ch), prompt_set, config.output_len)
        shape = await fleet.learn_shape()
        log.info("chaos: desired workers %s; computing the fault-free reference", dict(shape))
        reference = await load.reference()
        stop = asyncio.Event()
        sending = asyncio.create_task(load.poisson(config.rate, stop, rng))
        faults = await _inject(config, fleet)
        stop.set()
        await sending
        log.info("chaos: load stopped after %d requests; waiting for them to end", len(load.outcomes))
        await load.settle(config.settle_timeout_s)
        blocks = await fleet.idle_blocks(config.idle_timeout_s)
        in_flight = await fleet.in_flight()
    return summarize(load.outcomes, reference, faults, blocks, in_flight)


async def _inject(config: ChaosConfig, fleet: Fleet) -> list[Fault]:
    faults: list[Fault] = []
    for i, (kind, role) in enumerate(config.schedule()):
        await asyncio.sleep(config.interval_s)
        if not await fleet.settled():
            log.warning("chaos: the cluster is not back at its desired shape; faulting it anyway")
        fault = await (fleet.kill() if kind == "kill" else fleet.stop(role, config.stop_s))
        recovered = "not recovered" if fault.recover_s is None else f"recovered in {fault.recover_s:.2f} s"
        log.info(
            "chaos: fault %d/%d: %s %s (pid %d), %s",
            i + 1,
            config.kills + config.stops,
            kind,
            fault.worker,
            fault.pid,
            recovered,
        )
        faults.append(fault)
    await asyncio.sleep(config.interval_s)  # the load goes on a while after the last recovery
    return faults
