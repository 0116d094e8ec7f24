"""`python -m tests.unit.loadgen.interruptible LOADGEN-FLAGS`: loadgen against a scripted server whose last
session answers its first request and holds the others open forever, printing HOLDING on stdout once
`--num-prompts` - 1 are held, so that a test can Ctrl-C it mid-run at a known point without timing anything."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loadgen import benchmark
from loadgen.__main__ import main
from loadgen.client import Send
from loadgen.record import RequestRecord
from loadgen.workload import Request

HOLDING = "HOLDING"


class HoldingBackend:
    """Sessions before the `hold_in`th answer every request with two tokens; that one holds all but its first."""

    def __init__(self, hold_in: int, to_hold: int) -> None:
        self.sessions, self.hold_in, self.to_hold = 0, hold_in, to_hold
        self.all_held = asyncio.Event()

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncIterator[Send]:
        self.sessions += 1
        holding = self.sessions == self.hold_in
        answered, held = [], []

        async def send(req: Request, record: RequestRecord) -> None:
            if holding and answered:
                held.append(record)
                if len(held) == self.to_hold:
                    self.all_held.set()
                    print(HOLDING, flush=True)
                await asyncio.Event().wait()  # never set: only a cancel ends it
            answered.append(record)
            record.message_times_s, record.message_tokens = [0.1, 0.2], [1, 1]

        yield send


if __name__ == "__main__":
    flags = sys.argv[1:]
    num_prompts, rates = int(flags[flags.index("--num-prompts") + 1]), flags[flags.index("--request-rate") + 1]
    backend = HoldingBackend(hold_in=1 + len(rates.split(",")), to_hold=num_prompts - 1)  # the check, then each rate
    benchmark.make_backend = lambda config: backend  # type: ignore[assignment]
    sys.exit(main(flags))
